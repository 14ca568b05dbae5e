"""A Python front end as the partner of a native front end (``--frontend-impl native``, server/native/): the native
one terminates gRPC on the public port, answers plain ModelInfer requests itself and hands this process every other
call over a private Unix socket. Here: who the client of such a call is (the native front end says, in
``x-voxserve-peer``), and the native front end's reports of the calls it answered itself, accounted for here as if
this process had served them (voxserve_* request metrics, ModelStatistics).

A report is the body of a unary ``/voxserve.internal.FrontendReport/Report`` call (no protobuf): a header of
REPORT_HEADER (the native front end's calls in progress now, the record count), then that many RECORD rows.
"""

from __future__ import annotations

import grpc
import numpy as np

from ..metrics import INPUT_PATHS
from .inference import HttpCall, InferenceService

REPORT_SERVICE = "voxserve.internal.FrontendReport"
REPORT_METHOD = f"/{REPORT_SERVICE}/Report"
PEER_HEADER = "x-voxserve-peer"  # the client's address, as the native front end saw it (it replaces a client's own)
# calls in progress in the native front end, records that follow (little-endian)
REPORT_HEADER = np.dtype([("inflight", "<i8"), ("count", "<u4"), ("pad", "V4")])
# one call the native front end answered: its gRPC status code, whether it named the served model (always, there),
# the path its input came by (its index in metrics.INPUT_PATHS), nanoseconds from arrival to the end, in the
# engine's queue, its samples and input bytes (0 when it got no further)
RECORD = np.dtype([("code", "u1"), ("served", "u1"), ("path", "u1"), ("pad", "V5"), ("elapsed_ns", "<i8"),
                   ("queue_ns", "<i8"), ("samples", "<i8"), ("input_bytes", "<i8")])


def forwarded_peer(context) -> str:
    """The client of a call handed over by the native front end (for the RPC limit's fair shares, the access log):
    its ``x-voxserve-peer``; the call's own peer if it has none."""
    for key, value in context.invocation_metadata() or ():
        if key == PEER_HEADER:
            return value if isinstance(value, str) else value.decode("latin-1")
    return context.peer() or ""


def call_peer(call) -> str:
    """The client of a call this partner serves, for the access log: a REST call's own (it came straight here), a gRPC
    call's as the native front end names it."""
    return call.peer() if isinstance(call, HttpCall) else forwarded_peer(call)


class Reports:
    """Applies the native front end's reports to this process's accounting (``InferenceService.account``)."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service
        self.inflight = 0  # the native front end's calls in progress, as last reported (in voxserve_inflight_requests)

    def apply(self, body: bytes) -> int:
        """Account for every record of one report; its record count. ValueError for a body that is not one."""
        if len(body) < REPORT_HEADER.itemsize:
            raise ValueError(f"a report of {len(body)} bytes has no header ({REPORT_HEADER.itemsize} bytes)")
        header = np.frombuffer(body, REPORT_HEADER, 1)[0]
        count, inflight = int(header["count"]), int(header["inflight"])
        if len(body) != REPORT_HEADER.itemsize + count * RECORD.itemsize or inflight < 0:
            raise ValueError(f"a report announcing {count} records and {inflight} calls in progress has {len(body)} "
                             f"bytes, not {REPORT_HEADER.itemsize + count * RECORD.itemsize}")
        records = np.frombuffer(body, RECORD, count, REPORT_HEADER.itemsize)
        if count and int(records["path"].max()) >= len(INPUT_PATHS):
            raise ValueError(f"a report's record names input path {int(records['path'].max())}; there are "
                             f"{len(INPUT_PATHS)} ({', '.join(INPUT_PATHS)})")
        if count:
            self.service.account(records["code"], records["served"], records["elapsed_ns"], records["queue_ns"],
                                 records["samples"], records["input_bytes"], records["path"])
        self.service.metrics.series.inflight.inc(inflight - self.inflight)
        self.inflight = inflight
        return count

    async def _report(self, body: bytes, context) -> bytes:
        try:
            self.apply(body)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return b""

    def handler(self) -> grpc.GenericRpcHandler:
        """The report method's handler (bytes in, bytes out)."""
        return grpc.method_handlers_generic_handler(REPORT_SERVICE, {
            "Report": grpc.unary_unary_rpc_method_handler(self._report)})
