"""Tests of the native front end (server/native/): the voxserve-frontend binary against real and scripted engines."""
