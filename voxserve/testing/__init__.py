"""Tools for testing voxserve and servers like it: request fuzzing and load generation."""
