"""The peer for bench/service_bench.py: voxserve's model served by Triton's Python backend.

Each model instance is a stub process that builds the same ``Model`` voxserve serves (the default weights,
the fused op on a GPU, the CPU path without one), warmed up against float64 the same way, so Triton's rows
differ from voxserve's in the serving stack alone. The dynamic batcher hands ``execute`` the requests it
gathered; requests of one sample shape run as one execution (the batcher only gathers equal shapes).

Tensors cross the backend by DLPack, never ``as_numpy()``/``Tensor(name, array)``: the stub of Triton 2.51
was built against NumPy 1, and under NumPy 2 those read and write the wrong bytes (right shape, wrong data;
an output comes back empty), while DLPack hands torch the stub's own buffers.

Parameters (config.pbtxt): ``device`` (voxserve's --device), ``max_batch``, ``sys_path`` (the benchmark's
import path, os.pathsep-separated: the stub does not read PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import sys

import triton_python_backend_utils as pb_utils  # provided by the Python backend's stub


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        for path in params.get("sys_path", "").split(os.pathsep):
            if path and path not in sys.path:
                sys.path.append(path)
        import torch
        from torch.utils import dlpack

        from voxserve.server.core.model import Model, select_device
        from voxserve.server.core.weights import default_weights

        self.torch, self.dlpack = torch, dlpack
        self.wire = {"TYPE_FP32": "FP32", "TYPE_FP16": "FP16"}[config["input"][0]["data_type"]]
        device, kernel = select_device(params.get("device", "auto"))
        self.model = Model(default_weights(), device, kernel, int(params.get("max_batch", "128")))
        err = self.model.warm_up()
        pb_utils.Logger.log_info(f"voxnet {self.wire} on {device} ({kernel}): warm-up relative error {err:.1e}")

    def execute(self, requests: list) -> list:
        # torch's own NumPy view of each input (the stub's buffer, no copy)
        arrays = [self.dlpack.from_dlpack(pb_utils.get_input_tensor_by_name(r, "input").to_dlpack()).numpy()
                  for r in requests]
        responses: list = [None] * len(requests)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, a in enumerate(arrays):
            by_shape.setdefault(a.shape[1:], []).append(i)
        for indices in by_shape.values():
            try:
                y, _ = self.model.run_arrays([arrays[i] for i in indices], self.wire)
            except Exception as exc:  # one failed execution fails its own requests, not the others
                error = pb_utils.TritonError(f"{type(exc).__name__}: {exc}")
                for i in indices:
                    responses[i] = pb_utils.InferenceResponse(error=error)
                continue
            out = self.torch.from_numpy(y)
            start = 0
            for i in indices:
                n = arrays[i].shape[0]
                tensor = pb_utils.Tensor.from_dlpack("output", self.dlpack.to_dlpack(out[start : start + n]))
                responses[i] = pb_utils.InferenceResponse([tensor])
                start += n
        return responses
