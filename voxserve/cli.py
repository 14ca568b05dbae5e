"""The `voxserve` command: serve, infer, health, bench, weights, kernel."""

from __future__ import annotations

import argparse
import os
import socket
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from voxserve import __version__
from voxserve.datatypes import CLI_DTYPES

if TYPE_CHECKING:
    from voxserve.server.settings import Settings

DEFAULT_URL = "localhost:8001"
NPY_MAGIC = b"\x93NUMPY"


class UsageError(Exception):
    """A mistake in what the user gave a command (a flag, a file): printed as one line naming it, exit 2."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with a mistake in the arguments told in one line (argparse prints the whole usage
    first: 28 lines for serve's flags) and where to read them."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (--help lists the flags)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if len(shape) != 5 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: need five positive sizes N,C,D,H,W")
    return shape


def _sample_shape(text: str) -> tuple[int, ...]:
    shape = _int_list(text)
    if len(shape) != 4:
        raise argparse.ArgumentTypeError(f"{text!r}: need four positive sizes C,D,H,W")
    return tuple(shape)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: values must be positive")
    return values


def _add_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get("VOXSERVE_URL", DEFAULT_URL),
                        help="server address HOST:PORT [env VOXSERVE_URL; default: %(default)s]")
    parser.add_argument("--model-name", default=os.environ.get("VOXSERVE_MODEL_NAME", "voxnet"),
                        help="model to address [env VOXSERVE_MODEL_NAME; default: %(default)s]")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="per-call deadline in seconds")
    env = os.environ
    sec = parser.add_argument_group("security", "TLS, mutual TLS and bearer-token credentials")
    sec.add_argument("--tls", action=argparse.BooleanOptionalAction,
                     default=env.get("VOXSERVE_TLS", "").lower() in ("1", "true", "yes", "on"),
                     help="connect with TLS, verifying the server against the system's roots or --tls-ca "
                     "[env VOXSERVE_TLS]")
    sec.add_argument("--tls-ca", metavar="CA.pem", default=env.get("VOXSERVE_TLS_CA") or None,
                     help="PEM roots to verify the server's certificate (implies --tls) [env VOXSERVE_TLS_CA]")
    sec.add_argument("--tls-cert", metavar="CERT.pem", default=env.get("VOXSERVE_TLS_CLIENT_CERT") or None,
                     help="client certificate for mutual TLS [env VOXSERVE_TLS_CLIENT_CERT]")
    sec.add_argument("--tls-key", metavar="KEY.pem", default=env.get("VOXSERVE_TLS_CLIENT_KEY") or None,
                     help="private key of --tls-cert [env VOXSERVE_TLS_CLIENT_KEY]")
    sec.add_argument("--tls-server-name", default=env.get("VOXSERVE_TLS_SERVER_NAME") or None,
                     help="name to check in the server's certificate, if not the --url host "
                     "[env VOXSERVE_TLS_SERVER_NAME]")
    sec.add_argument("--auth-token-file", metavar="FILE", default=env.get("VOXSERVE_AUTH_TOKEN_FILE") or None,
                     help="send the bearer token in FILE (its first line) [env VOXSERVE_AUTH_TOKEN_FILE]")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="voxserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"voxserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the inference server",
                           description="Serve the model over gRPC (Open Inference Protocol) until SIGTERM/SIGINT. "
                           "Every flag has a VOXSERVE_* environment twin.")
    from voxserve.server.settings import add_arguments

    add_arguments(serve)

    infer = sub.add_parser("infer", help="send one inference request and print or save the result")
    _add_url(infer)
    source = infer.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", metavar="X.npy", help="input tensor (N, Cin, D, H, W) from a .npy file")
    source.add_argument("--random", metavar="N,C,D,H,W", type=_shape, help="a random normal input of this shape")
    infer.add_argument("--dtype", choices=sorted(CLI_DTYPES), default="fp32",
                       help="datatype on the wire (the server computes in fp32) [default: %(default)s]")
    infer.add_argument("--seed", type=int, default=None, help="seed for --random")
    infer.add_argument("--output", metavar="Y.npy", help="write the (N, Cout) result here instead of printing it")

    health = sub.add_parser("health", help="exit 0 if the server and model are ready, 1 otherwise")
    _add_url(health)

    weights = sub.add_parser("weights", help="make or convert weights files")
    wsub = weights.add_subparsers(dest="weights_command", required=True, metavar="ACTION")
    default = wsub.add_parser("default", help="write the reference instance's default weights")
    default.add_argument("out", metavar="OUT.safetensors")
    default.add_argument("--cin", type=_positive_int, default=3, help="input channels [default: %(default)s]")
    default.add_argument("--cout", type=_positive_int, default=16, help="output channels [default: %(default)s]")
    default.add_argument("-k", "--kernel-size", type=_positive_int, default=3,
                         help="kernel size [default: %(default)s]")
    default.add_argument("--seed", type=int, default=0, help="generator seed [default: %(default)s]")
    convert = wsub.add_parser("convert", help="convert a PyTorch state dict to safetensors",
                              description="Keys conv.weight/conv.bias or conv_weight/conv_bias; loaded with "
                              "weights_only=True (tensors only).")
    convert.add_argument("src", metavar="STATE_DICT.pt")
    convert.add_argument("out", metavar="OUT.safetensors")
    bench = sub.add_parser("bench", help="load-test a server: throughput and latency per concurrency level",
                           description="Sends the same request from N concurrent workers per level; prints "
                           "req/s, samples/s, MB/s and p50/p90/p99 latency, and the server's queue/compute split.")
    _add_url(bench)
    bench.add_argument("--batch", type=int, default=1, help="samples per request [default: %(default)s]")
    bench.add_argument("--shape", type=_sample_shape, default=(3, 16, 32, 32), metavar="C,D,H,W",
                       help="sample shape [default: 3,16,32,32]")
    bench.add_argument("--dtype", choices=sorted(CLI_DTYPES), default="fp32", help="wire datatype")
    bench.add_argument("--concurrency", type=_int_list, default=[1, 4, 16, 64], metavar="1,4,16,64",
                       help="concurrency levels [default: 1,4,16,64]")
    limit = bench.add_mutually_exclusive_group()
    limit.add_argument("--duration", type=float, default=10.0, help="seconds per level [default: %(default)s]")
    limit.add_argument("--requests", type=int, default=None, help="requests per level (instead of --duration)")
    memory = bench.add_mutually_exclusive_group()
    memory.add_argument("--shared-memory", action="store_true",
                        help="put input and output in system shared memory (client and server on one host)")
    memory.add_argument("--cuda-shared-memory", action="store_true",
                        help="put input and output in CUDA shared memory: device memory of the bench's own, "
                        "exported by CUDA IPC (client and server on one host; needs voxserve[cuda])")
    bench.add_argument("--cuda-device", type=int, default=0,
                       help="the device of --cuda-shared-memory's memory [default: %(default)s]")
    bench.add_argument("--connections", type=int, default=1,
                       help="connections the workers share (a server with --replicas serves each connection "
                       "on one replica) [default: %(default)s]")
    bench.add_argument("--processes", type=int, default=1,
                       help="load processes the workers and connections are split over: one Python process "
                       "sends a few thousand small requests a second, a server with --frontends takes more "
                       "[default: %(default)s]")
    bench.add_argument("--streaming", action="store_true",
                       help="send the requests as messages of one ModelStreamInfer stream per connection (the "
                            "server answers each stream's requests in order) instead of one ModelInfer call each")
    bench.add_argument("--compare-raw", action="store_true",
                       help="also send the same bytes to a trivial sink server: the raw gRPC ceiling")
    bench.add_argument("--json", action="store_true", help="print the results as JSON")
    bench.add_argument("--plot", metavar="OUT.png", help="write a latency-vs-throughput plot (needs matplotlib)")

    kernel = sub.add_parser("kernel", help="build the fused CUDA kernel ahead of time (no GPU needed)")
    ksub = kernel.add_subparsers(dest="kernel_command", required=True, metavar="ACTION")
    kbuild = ksub.add_parser("build", help="compile kernels/csrc/fused.cu with nvcc into the kernel cache",
                             description="Builds the shared library the server loads on a GPU; the cache is "
                             "$VOXSERVE_KERNEL_CACHE or ~/.cache/voxserve/kernels. Prints one line: the library, "
                             "the build time (or the cache), and ptxas's registers and spills; its whole report "
                             "is kept beside the library.")
    kbuild.add_argument("--arch", default=None,
                        help="CUDA architectures, e.g. '9.0a' (H100/H200: the warpgroup kernel needs the 'a') or "
                        "'8.0;9.0a' [default: VOXSERVE_CUDA_ARCH_LIST, TORCH_CUDA_ARCH_LIST, the visible GPUs "
                        "(9.0 as 9.0a), else 9.0a]")
    kbuild.add_argument("--force", action="store_true", help="rebuild even when a cached build exists")
    kbuild.add_argument("--verbose", action="store_true", help="also print ptxas's whole report")
    return parser


def _readable(flag: str | None, path: str | None) -> None:
    """UsageError naming ``flag`` (if the file came from one) and ``path`` unless ``path`` is a file this
    process can read (None: not given)."""
    if path is None:
        return
    what = f"{flag} {path}" if flag else path
    if not os.path.exists(path):
        raise UsageError(f"{what}: no such file")
    if os.path.isdir(path):
        raise UsageError(f"{what}: is a folder, not a file")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise UsageError(f"{what}: cannot be read ({exc.strerror or exc})") from None


def _writable(what: str, path: str) -> None:
    """UsageError unless ``path`` can be created or replaced: before the work whose result goes there."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{what}: is a folder; give a file name in it")
    folder = target.parent
    if not folder.is_dir():
        raise UsageError(f"{what}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{what}: folder {str(folder)!r} is not writable")


def _check_tls_files(server: bool, cert: tuple[str, str | None], key: tuple[str, str | None],
                     ca: tuple[str, str | None]) -> None:
    """Parse the PEM files as the TLS library will, so that a wrong file is one line naming its flag here
    rather than a failed bind (the server) or a logged handshake error (a client). Each is (flag, path)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    context.set_ciphers("DEFAULT:@SECLEVEL=0")  # whether the files parse, not OpenSSL's policy (1024-bit RSA)
    if ca[1]:
        try:
            context.load_verify_locations(cafile=ca[1])
        except (ssl.SSLError, ValueError) as exc:
            raise UsageError(f"{ca[0]} {ca[1]}: not a PEM file of CA certificates ({_ssl_reason(exc)})") from None
    if cert[1] and key[1]:
        try:
            context.load_cert_chain(cert[1], key[1], password="")  # an encrypted key fails: gRPC cannot use it
        except (ssl.SSLError, ValueError) as exc:
            raise UsageError(f"{cert[0]} {cert[1]} with {key[0]} {key[1]}: not a PEM certificate and its "
                             f"unencrypted private key ({_ssl_reason(exc)})") from None


def _ssl_reason(exc: Exception) -> str:
    reason = getattr(exc, "reason", None)
    return str(reason).lower().replace("_", " ") if reason else "its PEM does not parse"


def _credentials(args: argparse.Namespace):
    """Credentials from the security flags; UsageError naming the flag when a file is missing or unusable."""
    from voxserve.client.security import Credentials

    for flag, path in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                       ("--auth-token-file", args.auth_token_file)):
        _readable(flag, path)
    _check_tls_files(False, ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                     ("--tls-ca", args.tls_ca))
    try:
        return Credentials.from_files(tls=args.tls, ca_file=args.tls_ca, cert_file=args.tls_cert,
                                      key_file=args.tls_key, token_file=args.auth_token_file,
                                      server_name=args.tls_server_name)
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def _bench(args: argparse.Namespace) -> int:
    from voxserve.client.bench import main as bench_main
    from voxserve.client.cuda import CudaError

    args.dtype = CLI_DTYPES[args.dtype]
    args.credentials = _credentials(args)
    try:
        return bench_main(args)
    except CudaError as exc:  # no cuda-bindings, no GPU, memory CUDA would not give or export
        raise UsageError(f"--cuda-shared-memory: {exc}") from None


def _kernel(args: argparse.Namespace) -> int:
    from voxserve.kernels import build

    try:
        archs = build.parse_arch_list(args.arch) if args.arch else None
    except build.KernelBuildError as exc:
        raise UsageError(f"--arch: {exc}") from None
    try:
        result = build.build(archs, force=args.force)
    except build.KernelBuildError as exc:
        print(f"voxserve kernel build: {exc}", file=sys.stderr)
        return 1
    if args.verbose:
        print(result.ptxas_report.rstrip())
    print(result.summary() + ("" if args.verbose else f"; ptxas's report: {result.report_path} (or --verbose)"))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from voxserve.server.settings import from_namespace

    try:
        from voxserve.server.app import serve
        from voxserve.server.topology.roles import Role
    except ImportError as exc:  # a client-only install
        print(f"voxserve serve needs the server extra (pip install 'voxserve[server]'): {exc}", file=sys.stderr)
        return 2

    try:
        settings = from_namespace(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not Role.from_environment().supervised:  # a supervisor's children: it checked for them
        _check_serve_inputs(settings)
    return serve(settings)


def _check_serve_inputs(settings: Settings) -> None:
    """What the user gave `serve`, checked before any process starts or any port opens, in every topology
    (--replicas and --frontends read the weights in their children, after the front ends have bound): the
    address and ports, the weights, the TLS and token files. The server checks them again (exit 1 when one
    of them goes wrong between here and there)."""
    from voxserve.server.core import weights as weights_io
    from voxserve.server.protocol import security
    from voxserve.server.topology import ports

    host = settings.host
    chosen = [(flag, port) for flag, port in (("--grpc-port", settings.grpc_port), ("--http-port", settings.http_port),
                                              ("--metrics-port", settings.metrics_port))]
    for i, (flag, port) in enumerate(chosen):
        for earlier, earlier_port in chosen[:i]:
            if port > 0 and port == earlier_port:
                raise UsageError(f"{flag} {port}: the same port as {earlier}; give each its own")
    try:
        for flag, port in chosen:
            ports.ensure_free(host, port, flag)
        family, address = ports.bind_address(host)
        with socket.socket(family, socket.SOCK_STREAM) as probe:  # the address itself, whatever the ports
            probe.bind((address, 0))
    except ports.PortInUse as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"--host {host}: cannot listen on this address ({exc.strerror or exc})") from None
    _readable("--weights", settings.weights or None)
    try:
        if settings.weights:
            weights_io.load(settings.weights)
        security.server_credentials(settings.tls_cert or None, settings.tls_key or None,
                                    settings.tls_client_ca or None)
        if settings.auth_token_file:
            security.load_tokens(settings.auth_token_file)
    except (weights_io.WeightsError, security.SecurityConfigError) as exc:
        raise UsageError(str(exc)) from None
    _check_tls_files(True, ("--tls-cert", settings.tls_cert or None),
                     ("--tls-key", settings.tls_key or None), ("--tls-client-ca", settings.tls_client_ca or None))
    if settings.http_port >= 0:  # the REST port's TLS reads the same files (checked above, line by line)
        try:
            security.server_ssl_context(settings.tls_cert or None, settings.tls_key or None,
                                        settings.tls_client_ca or None)
        except security.SecurityConfigError as exc:
            raise UsageError(str(exc)) from None


def _read_input(path: str) -> np.ndarray:
    """The array in a .npy file (never a pickle); UsageError naming --input when it is not one of real numbers."""
    _readable("--input", path)
    try:
        with open(path, "rb") as f:
            if f.read(len(NPY_MAGIC)) != NPY_MAGIC:
                raise UsageError(f"--input {path}: not a .npy file (numpy.save writes them)")
            f.seek(0)
            x = np.load(f, allow_pickle=False)
    except OSError as exc:
        raise UsageError(f"--input {path}: cannot be read ({exc.strerror or exc})") from None
    except (ValueError, EOFError) as exc:
        if "allow_pickle" in str(exc):
            raise UsageError(f"--input {path}: holds Python objects, which are never unpickled; save an array "
                             f"of numbers") from None
        raise UsageError(f"--input {path}: not a readable .npy file ({exc})") from None
    if x.dtype.kind not in "biuf":
        raise UsageError(f"--input {path}: holds {x.dtype} values; the model takes real numbers (float32, "
                         f"float16, ...)")
    return x


def _infer(args: argparse.Namespace) -> int:
    from voxserve.client import Client, InferenceError

    credentials = _credentials(args)
    if args.output:
        _writable(f"--output {args.output}", args.output)
    if args.input:
        x = _read_input(args.input)
    else:
        x = np.random.default_rng(args.seed).standard_normal(args.random, dtype=np.float32)
    with Client(args.url, model=args.model_name, timeout_s=args.timeout_s, credentials=credentials) as client:
        try:
            y = client.infer(x, datatype=CLI_DTYPES[args.dtype])
        except InferenceError as exc:
            print(f"voxserve infer: {exc}", file=sys.stderr)
            return 1
    if args.output:
        try:
            np.save(args.output, y)
        except OSError as exc:
            raise UsageError(f"--output {args.output}: cannot be written ({exc.strerror or exc})") from None
        print(f"wrote {args.output}: shape {y.shape}, {y.dtype}")
    else:
        np.set_printoptions(precision=6, suppress=True, linewidth=160)
        print(y)
    return 0


def _not_ready_reason(url: str, model: str, timeout_s: float, exc) -> str:
    """Why a health call failed, in words, from its gRPC status."""
    import grpc

    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"cannot reach {url}: {details}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer from {url} within {timeout_s:g} s (--timeout-s)"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return (f"{url} refused the call (UNAUTHENTICATED: {details}); give its token with --auth-token-file, "
                f"or serve with --open-health")
    if code == grpc.StatusCode.NOT_FOUND:
        return f"{url} does not serve model {model!r} (NOT_FOUND; --model-name)"
    return f"{code.name}: {details}"


def _health(args: argparse.Namespace) -> int:
    import grpc

    from voxserve.proto import pb, pb_grpc

    credentials = _credentials(args)
    metadata = credentials.metadata()
    with credentials.channel(args.url, []) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        try:
            if not stub.ServerReady(pb.ServerReadyRequest(), timeout=args.timeout_s, metadata=metadata).ready:
                reason = (f"{args.url} answers but is not serving (NOT_SERVING: still loading and warming up, "
                          f"draining, or its device failed)")
            elif not stub.ModelReady(pb.ModelReadyRequest(name=args.model_name), timeout=args.timeout_s,
                                     metadata=metadata).ready:
                reason = f"model {args.model_name!r} is not ready (NOT_SERVING)"
            else:
                reason = ""
        except grpc.RpcError as exc:
            reason = _not_ready_reason(args.url, args.model_name, args.timeout_s, exc)
    print(f"not ready: {reason}" if reason else "ready")
    return 1 if reason else 0


def _weights(args: argparse.Namespace) -> int:
    from safetensors import SafetensorError

    from voxserve.kernels import reference_weights
    from voxserve.server.core import weights as weights_io

    if args.weights_command == "convert":
        _readable(None, args.src)
    _writable(args.out, args.out)
    try:
        if args.weights_command == "default":
            source = f"--cin {args.cin} --cout {args.cout} -k {args.kernel_size}"
            if max(args.cin, args.cout) > weights_io.MAX_CHANNELS or args.kernel_size > weights_io.MAX_KERNEL_SIZE:
                raise UsageError(f"{source}: channels go up to {weights_io.MAX_CHANNELS}, the kernel size up to "
                                 f"{weights_io.MAX_KERNEL_SIZE}")
            w, b = reference_weights(args.cin, args.cout, args.kernel_size, args.seed)
            result = weights_io.check(w, b, source)
            weights_io.save(result, args.out)
        else:
            result = weights_io.convert_state_dict(args.src, args.out)
    except weights_io.WeightsError as exc:
        raise UsageError(str(exc)) from None
    except (OSError, SafetensorError) as exc:
        raise UsageError(f"{args.out}: cannot be written ({getattr(exc, 'strerror', None) or exc})") from None
    print(f"wrote {args.out}: conv.weight {tuple(result.weight.shape)}, conv.bias {tuple(result.bias.shape)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if not argv:  # what a new user types first: the commands, not an error
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    handlers = {"serve": _serve, "infer": _infer, "health": _health, "weights": _weights, "kernel": _kernel,
                "bench": _bench}
    try:
        return handlers[args.command](args)
    except UsageError as exc:
        print(f"voxserve {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a server's own handler is in place, or in a client command
        print(f"voxserve {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
