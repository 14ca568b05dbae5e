"""The `voxserve` command: serve, infer, health, bench, weights, kernel."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import numpy as np

from voxserve import __version__
from voxserve.datatypes import CLI_DTYPES

DEFAULT_URL = "localhost:8001"


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
    parser = argparse.ArgumentParser(prog="voxserve", description=__doc__)
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
    default.add_argument("--cin", type=int, default=3, help="input channels [default: %(default)s]")
    default.add_argument("--cout", type=int, default=16, help="output channels [default: %(default)s]")
    default.add_argument("-k", "--kernel-size", type=int, default=3, help="kernel size [default: %(default)s]")
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
    bench.add_argument("--shared-memory", action="store_true",
                       help="put input and output in system shared memory (client and server on one host)")
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
                             "$VOXSERVE_KERNEL_CACHE or ~/.cache/voxserve/kernels. Prints the ptxas report.")
    kbuild.add_argument("--arch", default=None,
                        help="CUDA architectures, e.g. '9.0' or '8.0;9.0a' [default: VOXSERVE_CUDA_ARCH_LIST, "
                        "TORCH_CUDA_ARCH_LIST, the visible GPUs, else 9.0]")
    kbuild.add_argument("--force", action="store_true", help="rebuild even when a cached build exists")
    return parser


def _credentials(args: argparse.Namespace):
    """Credentials from the security flags; exits 2 with the reason when a file is missing or unusable."""
    from voxserve.client.security import Credentials

    try:
        return Credentials.from_files(tls=args.tls, ca_file=args.tls_ca, cert_file=args.tls_cert,
                                      key_file=args.tls_key, token_file=args.auth_token_file,
                                      server_name=args.tls_server_name)
    except (OSError, ValueError) as exc:
        print(f"voxserve {args.command}: {exc}", file=sys.stderr)
        sys.exit(2)


def _bench(args: argparse.Namespace) -> int:
    from voxserve.client.bench import main as bench_main

    args.dtype = CLI_DTYPES[args.dtype]
    args.credentials = _credentials(args)
    return bench_main(args)


def _kernel(args: argparse.Namespace) -> int:
    from voxserve.kernels import build

    try:
        archs = build.parse_arch_list(args.arch) if args.arch else None
        result = build.build(archs, force=args.force)
    except build.KernelBuildError as exc:
        print(f"voxserve kernel build: {exc}", file=sys.stderr)
        return 1
    report = [line for line in result.ptxas_report.splitlines() if "registers" in line or "spill" in line]
    print("\n".join(report))
    how = f"built in {result.seconds:.1f} s" if result.seconds else "already built (cache)"
    print(f"{result.path} for {','.join(result.archs)}: {how}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from voxserve.server.settings import from_namespace

    try:
        from voxserve.server.app import serve
    except ImportError as exc:  # a client-only install
        print(f"voxserve serve needs the server extra (pip install 'voxserve[server]'): {exc}", file=sys.stderr)
        return 2

    try:
        settings = from_namespace(args)
    except ValueError as exc:
        print(f"voxserve serve: {exc}", file=sys.stderr)
        return 2
    return serve(settings)


def _infer(args: argparse.Namespace) -> int:
    from voxserve.client import Client, InferenceError

    if args.input:
        x = np.load(args.input, allow_pickle=False)
    else:
        x = np.random.default_rng(args.seed).standard_normal(args.random, dtype=np.float32)
    with Client(args.url, model=args.model_name, timeout_s=args.timeout_s, credentials=_credentials(args)) as client:
        try:
            y = client.infer(x, datatype=CLI_DTYPES[args.dtype])
        except InferenceError as exc:
            print(f"voxserve infer: {exc}", file=sys.stderr)
            return 1
    if args.output:
        np.save(args.output, y)
        print(f"wrote {args.output}: shape {y.shape}, {y.dtype}")
    else:
        np.set_printoptions(precision=6, suppress=True, linewidth=160)
        print(y)
    return 0


def _health(args: argparse.Namespace) -> int:
    from voxserve.client import Client

    with Client(args.url, model=args.model_name, timeout_s=args.timeout_s, credentials=_credentials(args)) as client:
        ready = client.is_ready()
    print("ready" if ready else "not ready")
    return 0 if ready else 1


def _weights(args: argparse.Namespace) -> int:
    from voxserve.kernels import reference_weights
    from voxserve.server.core import weights as weights_io

    try:
        if args.weights_command == "default":
            w, b = reference_weights(args.cin, args.cout, args.kernel_size, args.seed)
            result = weights_io.check(w, b, "generated")
            weights_io.save(result, args.out)
        else:
            result = weights_io.convert_state_dict(args.src, args.out)
    except weights_io.WeightsError as exc:
        print(f"voxserve weights: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: conv.weight {tuple(result.weight.shape)}, conv.bias {tuple(result.bias.shape)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"serve": _serve, "infer": _infer, "health": _health, "weights": _weights, "kernel": _kernel,
                "bench": _bench}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
