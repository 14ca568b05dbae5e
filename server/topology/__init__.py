"""The topology room: which process runs what.

``roles`` (what a process is, told by its supervisor), ``executors`` (the one factory of a process's executor:
in process, or the engines of a front end), ``supervisor`` (``--replicas`` and ``--frontends``: starts,
watches and stops the processes), ``engine`` (a process that owns a device and serves executions to front
ends), ``remote`` (a front end's executor, over the engine's socket), ``ipc`` (the messages and framing
between them) and ``ports`` (binding, and refusing ports that another process holds).
"""
