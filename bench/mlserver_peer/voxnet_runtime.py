"""The peer for bench/service_bench.py: the same model served by MLServer as a custom runtime running eager
PyTorch (conv3d -> hardswish -> relu -> softmax over channels -> mean over D, H, W), the way a team would
serve it without a fused kernel. Weights come from weights.npz beside model-settings.json.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri


class VoxnetEager(MLModel):
    async def load(self) -> bool:
        weights = np.load(await get_model_uri(self.settings), allow_pickle=False)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.weight = torch.from_numpy(weights["weight"]).to(self.device)
        self.bias = torch.from_numpy(weights["bias"]).to(self.device)
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = torch.from_numpy(np.ascontiguousarray(NumpyCodec.decode_input(payload.inputs[0]))).to(self.device)
        with torch.inference_mode():
            y = F.conv3d(x.float(), self.weight, self.bias)
            y = F.relu(F.hardswish(y))
            y = torch.softmax(y, dim=1).mean(dim=(2, 3, 4))
        return InferenceResponse(model_name=self.name, outputs=[NumpyCodec.encode_output("output", y.cpu().numpy())])
