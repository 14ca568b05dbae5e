"""Tests of the protocol room (server/protocol/): decoding, validation, limits, shared memory, security."""
