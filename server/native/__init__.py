"""The native front end, ``voxserve-frontend`` (C++, gRPC's callback API): the hot path of a front-end slot of
``--frontends``, beside the Python front end that serves everything else (README.md, ``--frontends``).
``build.build()`` compiles it (or finds it cached, or takes $VOXSERVE_NATIVE_FRONTEND); ``build.problem()`` says
why it cannot be had here, or None."""
