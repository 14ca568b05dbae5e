"""The model in this process: its weights read and its models built, one per serving device, each warmed up.

What a server with the model in process (standalone, one of --replicas) and an engine of --frontends do
before they serve; a front end, whose engines hold the model, never imports this (nor torch).
"""

from __future__ import annotations

import logging
import time

from ..metrics import Metrics
from ..settings import Settings
from . import weights as weights_io
from .model import Model, select_devices

log = logging.getLogger("voxserve")


def load_weights(settings: Settings, metrics: Metrics) -> weights_io.Weights:
    """--weights (or the default weights), timed as the start-up phase 'weights'."""
    t0 = time.perf_counter()
    weights = weights_io.load(settings.weights) if settings.weights else weights_io.default_weights()
    metrics.startup_duration.labels(settings.model_name, "weights").set(time.perf_counter() - t0)
    return weights


def build_models(settings: Settings, weights: weights_io.Weights, metrics: Metrics) -> list[Model]:
    """One model per serving device (--device / --devices), each warmed up against float64 before it serves."""
    s = settings
    log.info("weights: %s (Cout=%d, Cin=%d, k=%d)", weights.source, weights.cout, weights.cin, weights.k)
    startup = metrics.startup_duration
    t0 = time.perf_counter()
    chosen = select_devices(s.device, s.devices)  # on a GPU: builds or loads the fused kernel
    startup.labels(s.model_name, "kernel").set(time.perf_counter() - t0)
    models = []
    t0 = time.perf_counter()
    for device, kernel in chosen:
        model = Model(weights, device, kernel, s.max_batch, s.precision)
        err = model.warm_up()
        log.info("warm-up on %s matched the float64 reference (relative error %.1e)", device, err)
        models.append(model)
    startup.labels(s.model_name, "warmup").set(time.perf_counter() - t0)
    return models
