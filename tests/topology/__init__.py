"""Tests of the topology room (server/topology/): --replicas, --frontends, ports."""
