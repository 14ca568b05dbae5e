"""Drives a server with tritonclient.grpc, in its own process.

A process with tritonclient only, as a user's program would be (both clients in
one process: test_clients_together.py). Usage: tritonclient_driver.py URL WORKDIR, where
WORKDIR holds in_*.npy (fp32) and receives out_*.npy plus report.json.
"""

import json
import sys
from pathlib import Path

import numpy as np
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException


def main(url: str, workdir: Path) -> None:
    client = tc.InferenceServerClient(url=url)
    report = {
        "live": client.is_server_live(),
        "ready": client.is_server_ready(),
        "model_ready": client.is_model_ready("voxnet"),
        "metadata": client.get_model_metadata("voxnet", as_json=True),
        "config": client.get_model_config("voxnet", as_json=True),
        "server": client.get_server_metadata(as_json=True),
    }
    for path in sorted(workdir.glob("in_*.npy")):
        x = np.load(path)
        for datatype, arr in (("FP32", x), ("FP16", x.astype(np.float16))):
            inp = tc.InferInput("input", list(arr.shape), datatype)
            inp.set_data_from_numpy(arr)
            result = client.infer("voxnet", [inp], outputs=[tc.InferRequestedOutput("output")])
            np.save(workdir / f"out_{datatype}_{path.stem[3:]}.npy", result.as_numpy("output"))
    try:
        bad = tc.InferInput("input", [1, 3, 2, 4, 4], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 3, 2, 4, 4), np.float32))
        client.infer("voxnet", [bad])
        report["bad"] = "accepted"
    except InferenceServerException as exc:
        report["bad"] = {"status": exc.status(), "message": exc.message()}
    report["statistics"] = client.get_inference_statistics("voxnet", as_json=True)
    (workdir / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
