"""The voxserve server: protocol translation, model runner, metrics and lifecycle.

Import ``voxserve.server.app`` for the server itself; this package stays light
so that the CLI can read the settings without importing torch.
"""
