"""A user's mistake given to the CLI (a flag, a file, a port) is one line naming it and exit 2, never a traceback;
`voxserve health` says why a server is not ready."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from concurrent import futures

import grpc
import numpy as np
import pytest

from voxserve.cli import main
from voxserve.proto import pb, pb_grpc

from ..certs import CertificateAuthority
from ..conftest import REPO, running_server

GUARD_S = 120.0  # only so that a server that starts instead of refusing fails the test instead of hanging it


def _one_line(err: str, *names: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


# ---- infer --input / --output


def _npy_cases(tmp_path):
    text = tmp_path / "text.npy"
    text.write_text("1 2 3\n")
    objects = tmp_path / "objects.npy"
    np.save(objects, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    complex_values = tmp_path / "complex.npy"
    np.save(complex_values, np.zeros((1, 3, 4, 4, 4), np.complex64))
    strings = tmp_path / "strings.npy"
    np.save(strings, np.array(["a", "b"]))
    truncated = tmp_path / "truncated.npy"
    np.save(truncated, np.zeros((1, 3, 4, 4, 4), np.float32))
    truncated.write_bytes(truncated.read_bytes()[:200])
    return {
        "missing": (tmp_path / "nope.npy", "no such file"),
        "a folder": (tmp_path, "is a folder"),
        "a text file": (text, "not a .npy file"),
        "pickled objects": (objects, "never unpickled"),
        "complex numbers": (complex_values, "complex64"),
        "strings": (strings, "<U1"),
        "truncated": (truncated, "not a readable .npy file"),
    }


@pytest.mark.parametrize("case", ["missing", "a folder", "a text file", "pickled objects", "complex numbers",
                                  "strings", "truncated"])
def test_infer_input_that_is_not_an_array_of_numbers(tmp_path, capsys, case):
    path, reason = _npy_cases(tmp_path)[case]
    # No server is needed: the input is read before any call (a refused port would fail differently).
    assert main(["infer", "--url", "127.0.0.1:1", "--input", str(path)]) == 2
    _one_line(capsys.readouterr().err, f"--input {path}", reason)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_infer_input_without_read_permission(tmp_path, capsys):
    path = tmp_path / "x.npy"
    np.save(path, np.zeros((1, 3, 4, 4, 4), np.float32))
    path.chmod(0)
    assert main(["infer", "--url", "127.0.0.1:1", "--input", str(path)]) == 2
    _one_line(capsys.readouterr().err, f"--input {path}", "cannot be read")


@pytest.mark.parametrize("where", ["missing folder", "a folder"])
def test_infer_output_that_cannot_be_written_is_refused_before_the_call(tmp_path, capsys, where):
    out = tmp_path / "nope" / "y.npy" if where == "missing folder" else tmp_path
    assert main(["infer", "--url", "127.0.0.1:1", "--random", "1,3,4,4,4", "--output", str(out)]) == 2
    _one_line(capsys.readouterr().err, f"--output {out}")


@pytest.mark.parametrize(("flag", "content", "reason"), [
    ("--tls-ca", None, "no such file"),
    ("--tls-ca", "not a certificate\n", "not a PEM file"),
    ("--auth-token-file", None, "no such file"),
])
def test_client_security_files_are_named(tmp_path, capsys, flag, content, reason):
    path = tmp_path / "file.pem"
    if content is not None:
        path.write_text(content)
    assert main(["health", "--url", "127.0.0.1:1", flag, str(path)]) == 2
    _one_line(capsys.readouterr().err, f"{flag} {path}", reason)


def test_client_certificate_and_a_key_that_do_not_match(tmp_path, capsys):
    ca = CertificateAuthority(tmp_path, "c")
    one, other = ca.issue("one", server=False), ca.issue("other", server=False)
    assert main(["health", "--url", "127.0.0.1:1", "--tls-ca", str(ca.path), "--tls-cert", str(one.cert),
                 "--tls-key", str(other.key)]) == 2
    _one_line(capsys.readouterr().err, f"--tls-cert {one.cert}", f"--tls-key {other.key}", "mismatch")


# ---- weights


@pytest.mark.parametrize("where", ["missing folder", "a folder"])
def test_weights_default_into_a_place_that_cannot_be_written(tmp_path, capsys, where):
    out = tmp_path / "nope" / "w.safetensors" if where == "missing folder" else tmp_path
    assert main(["weights", "default", str(out)]) == 2
    _one_line(capsys.readouterr().err, str(out))


@pytest.mark.parametrize(("flags", "name"), [(["--cin", "0"], "--cin"), (["--cout", "-1"], "--cout"),
                                             (["-k", "0"], "-k")])
def test_weights_default_sizes_must_be_positive(tmp_path, capsys, flags, name):
    with pytest.raises(SystemExit) as exited:
        main(["weights", "default", str(tmp_path / "w.safetensors"), *flags])
    assert exited.value.code == 2
    assert f"argument {name}" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("argv", [["serve", "--frontends", "abc"], ["serve", "--no-such-flag"],
                                  ["infer", "--url", "h:1"], ["bench", "--concurrency", "0"]])
def test_a_flag_argparse_refuses_is_one_line(capsys, argv):
    """Not serve's whole usage (28 lines) before the one that matters."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "--help" in _one_line(capsys.readouterr().err)


def test_no_command_shows_the_commands(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert all(command in err for command in ("serve", "infer", "health", "bench", "weights", "kernel"))


def test_weights_default_sizes_over_the_limits(tmp_path, capsys):
    assert main(["weights", "default", str(tmp_path / "w.safetensors"), "-k", "9"]) == 2
    _one_line(capsys.readouterr().err, "-k 9", "up to 7")


def test_weights_convert_of_a_missing_file(tmp_path, capsys):
    src = tmp_path / "nope.pt"
    assert main(["weights", "convert", str(src), str(tmp_path / "w.safetensors")]) == 2
    _one_line(capsys.readouterr().err, f"{src}: no such file")


# ---- serve: ports, address, weights, TLS and token files


def _serve(*flags: str) -> subprocess.CompletedProcess:
    """``voxserve serve`` on loopback (CPU), run until it exits; one that starts serving fails the test."""
    proc = subprocess.Popen([sys.executable, "-m", "voxserve", "serve", "--device", "cpu", "--http-port", "0",
                             *flags], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=GUARD_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the server started instead of refusing its flags:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _assert_usage_error(result: subprocess.CompletedProcess, *names: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    line = _one_line(result.stderr, *names)
    assert line.startswith("voxserve serve: "), line


@pytest.mark.parametrize("topology", [[], ["--frontends", "2"]])
@pytest.mark.parametrize("flag", ["--grpc-port", "--http-port", "--metrics-port"])
def test_serve_on_a_port_a_running_server_holds(server, flag, topology):
    port = {"--grpc-port": server.port, "--http-port": server.server.http_port,
            "--metrics-port": server.server.metrics_port}[flag]
    ports = {"--grpc-port": "0", "--http-port": "0", "--metrics-port": "0", flag: str(port)}
    result = _serve("--host", "127.0.0.1", *(word for pair in ports.items() for word in pair), *topology)
    _assert_usage_error(result, flag, f"port {port} on 127.0.0.1 is in use")


@pytest.fixture
def serve_in_process(monkeypatch, capsys):
    """``voxserve serve FLAGS`` in this process, where starting the server fails the test: the CLI must refuse
    the flags before it starts anything. Returns the one line it printed."""
    import voxserve.server.app

    def started(settings):
        pytest.fail(f"the server was started with {settings}")

    monkeypatch.setattr(voxserve.server.app, "serve", started)

    def run(*flags: str, names: tuple[str, ...]) -> str:
        assert main(["serve", "--device", "cpu", *map(str, flags)]) == 2
        line = _one_line(capsys.readouterr().err, *names)
        assert line.startswith("voxserve serve: "), line
        return line

    return run


@pytest.mark.parametrize("topology", [[], ["--frontends", "2"]])
def test_serve_with_one_port_for_grpc_and_metrics(serve_in_process, topology):
    with socket.socket() as sock:  # a port free now (the server would bind gRPC to it, then fail on metrics)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve_in_process("--host", "127.0.0.1", "--grpc-port", port, "--metrics-port", port, *topology,
                     names=(f"--metrics-port {port}", "--grpc-port"))


def test_serve_with_one_port_for_grpc_and_rest(serve_in_process):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve_in_process("--host", "127.0.0.1", "--grpc-port", port, "--http-port", port, "--metrics-port", "-1",
                     names=(f"--http-port {port}", "--grpc-port"))


@pytest.mark.parametrize("host", ["192.0.2.1", "no-such-host.invalid"])  # (192.0.2.0/24: TEST-NET, not ours)
def test_serve_on_an_address_that_is_not_this_hosts(serve_in_process, host):
    serve_in_process("--host", host, "--grpc-port", "0", "--metrics-port", "-1", names=(f"--host {host}",
                                                                                          "cannot listen"))


@pytest.fixture
def bad_files(tmp_path):
    ca = CertificateAuthority(tmp_path, "s")
    one, other = ca.issue("one", server=True), ca.issue("other", server=True)
    fake = tmp_path / "fake.pem"
    fake.write_text("-----BEGIN CERTIFICATE-----\nnot base64 DER\n-----END CERTIFICATE-----\n")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_text("not safetensors\n")
    short = tmp_path / "tokens.txt"
    short.write_text("short\n")
    return {"one": one, "other": other, "fake": fake, "garbage": garbage, "short": short}


@pytest.mark.parametrize("case", ["fake certificate", "key of another certificate", "fake client CA",
                                  "garbage weights", "garbage weights, front ends", "weights folder",
                                  "short token"])
def test_serve_with_files_it_cannot_use(serve_in_process, bad_files, case):
    one, other, fake = bad_files["one"], bad_files["other"], bad_files["fake"]
    flags, names = {
        "fake certificate": (["--tls-cert", fake, "--tls-key", one.key], [f"--tls-cert {fake}"]),
        "key of another certificate": (["--tls-cert", one.cert, "--tls-key", other.key],
                                       [f"--tls-key {other.key}", "mismatch"]),
        "fake client CA": (["--tls-cert", one.cert, "--tls-key", one.key, "--tls-client-ca", fake],
                           [f"--tls-client-ca {fake}"]),
        "garbage weights": (["--weights", bad_files["garbage"]], [str(bad_files["garbage"])]),
        "garbage weights, front ends": (["--weights", bad_files["garbage"], "--frontends", "2"],
                                        [str(bad_files["garbage"])]),
        "weights folder": (["--weights", bad_files["garbage"].parent], [f"--weights {bad_files['garbage'].parent}",
                                                                         "is a folder"]),
        "short token": (["--auth-token-file", bad_files["short"]], ["--auth-token-file", "at least 16"]),
    }[case]
    serve_in_process("--host", "127.0.0.1", "--grpc-port", "0", "--metrics-port", "-1", *flags, names=tuple(names))


def _self_signed(tmp_path, bits: int) -> tuple[str, str]:
    """A self-signed certificate for localhost with an RSA key of ``bits``: (certificate file, key file)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=bits)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    (tmp_path / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "k.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    return str(tmp_path / "c.pem"), str(tmp_path / "k.pem")


def test_the_tls_check_refuses_only_what_cannot_be_used(tmp_path, monkeypatch):
    """A certificate gRPC serves with is let through, a weak (1024-bit RSA) one included: the check is whether
    the files parse and match, not OpenSSL's security policy (gRPC only here: the REST port's is OpenSSL's)."""
    import voxserve.server.app

    cert, key = _self_signed(tmp_path, 1024)
    started = []
    monkeypatch.setattr(voxserve.server.app, "serve", lambda settings: started.append(settings) or 0)
    assert main(["serve", "--device", "cpu", "--host", "127.0.0.1", "--grpc-port", "0", "--http-port", "-1",
                 "--metrics-port", "-1", "--tls-cert", cert, "--tls-key", key]) == 0
    assert len(started) == 1


def test_the_rest_port_refuses_a_key_openssl_deems_too_weak(tmp_path, serve_in_process):
    """The REST port's TLS is OpenSSL's, whose policy refuses a 1024-bit RSA key that gRPC serves: one line at
    start-up naming the files and the way out, not a server serving TLS on one port and failing on the other."""
    cert, key_file = _self_signed(tmp_path, 1024)
    line = serve_in_process("--host", "127.0.0.1", "--grpc-port", "0", "--http-port", "0", "--metrics-port", "-1",
                            "--tls-cert", cert, "--tls-key", key_file, names=(f"--tls-cert {cert}", "--http-port -1"))
    assert "REST port" in line


# ---- health says why


def _health(capsys, *flags: str) -> str:
    assert main(["health", *flags]) == 1
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1 and out.startswith("not ready: "), out
    return out


def test_health_connection_refused(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert "Connection refused" in _health(capsys, "--url", f"127.0.0.1:{port}", "--timeout-s", "10")


def test_health_no_answer_within_the_deadline(capsys):
    with socket.socket() as sock:  # listens (the kernel completes the handshake) but never speaks HTTP/2
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        url = f"127.0.0.1:{sock.getsockname()[1]}"
        assert f"no answer from {url} within 1 s" in _health(capsys, "--url", url, "--timeout-s", "1")


def test_health_unauthenticated(tmp_path, capsys):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("a-token-of-enough-characters\n")
    with running_server(auth_token_file=str(tokens)) as srv:  # the token check answers before the model loads
        out = _health(capsys, "--url", srv.url)
    assert "UNAUTHENTICATED" in out and "--auth-token-file" in out


class _NotReady(pb_grpc.GRPCInferenceServiceServicer):
    def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=False)


@contextlib.contextmanager
def _not_ready_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(_NotReady(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def test_health_not_serving(capsys):
    with _not_ready_server() as url:
        assert "NOT_SERVING" in _health(capsys, "--url", url)


def test_health_wrong_model_name(server, capsys):
    out = _health(capsys, "--url", server.url, "--model-name", "other")
    assert "'other'" in out and "--model-name" in out


def test_ctrl_c_is_one_line(monkeypatch, capsys):
    from voxserve.kernels import build

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "build", interrupted)
    assert main(["kernel", "build", "--arch", "9.0a"]) == 130
    assert _one_line(capsys.readouterr().err) == "voxserve kernel: interrupted"
