"""What `voxserve bench` prints: the first error of a level, columns named for what they count, the plot."""

from __future__ import annotations

import importlib.util
import json
import socket

import pytest

from voxserve.cli import main
from voxserve.client import bench


def test_bench_prints_the_first_errors_status_and_message(server, capsys):
    rc = main(["bench", "--url", server.url, "--shape", "4,4,5,6", "--concurrency", "2", "--requests", "3"])
    assert rc == 1  # wrong Cin: every request is rejected
    out = capsys.readouterr().out
    line = next(t for t in out.splitlines() if "the first:" in t)
    assert line.startswith("voxserve c=2: 3 of 3 requests failed; the first: INVALID_ARGUMENT: ")
    assert "channel" in line  # the server's own sentence (it names the channel count)
    rc = main(["bench", "--url", server.url, "--shape", "4,4,5,6", "--concurrency", "2", "--requests", "3", "--json"])
    level = json.loads(capsys.readouterr().out)["levels"][0]
    assert level["first_error"]["status"] == "INVALID_ARGUMENT" and "channel" in level["first_error"]["message"]
    rc = main(["bench", "--url", server.url, "--shape", "3,4,5,6", "--concurrency", "1", "--requests", "2", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["levels"][0]["first_error"] is None


def test_bench_columns_say_what_they_count_in_shared_memory(server, capsys):
    args = ["bench", "--url", server.url, "--batch", "2", "--shape", "3,8,8,8", "--concurrency", "1", "--requests",
            "3", "--shared-memory"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "0.00 MB on the wire" not in out
    tensor = 2 * 3 * 8 * 8 * 8 * 4
    assert f"{bench.format_bytes(tensor)} of input tensor in shared memory" in out
    header = next(t for t in out.splitlines() if t.startswith("target"))
    assert "tensor MB/s" in header and "wire MB/s" in header
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    level = report["levels"][0]
    assert level["mb_per_s"] == pytest.approx(level["requests_per_s"] * tensor / 1e6)
    assert level["wire_mb_per_s"] == pytest.approx(level["requests_per_s"] * report["request_bytes"] / 1e6)
    assert level["wire_mb_per_s"] < level["mb_per_s"] / 10  # the tensor bytes did not cross the socket
    assert report["server"].startswith("voxserve")


def test_format_bytes():
    assert [bench.format_bytes(n) for n in (312, 1234, 25_165_824, 3e9)] == ["312 B", "1.23 kB", "25.17 MB", "3.00 GB"]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_bench_plot_is_titled_and_says_where_it_wrote(server, tmp_path, capsys, monkeypatch):
    figures = []

    def keep(*args, **kwargs):
        figures.append(plot(*args, **kwargs))
        return figures[-1]

    plot = bench.plot
    monkeypatch.setattr(bench, "plot", keep)
    out = tmp_path / "curve.png"
    assert main(["bench", "--url", server.url, "--shape", "3,4,4,4", "--concurrency", "1,2", "--requests", "3",
                 "--plot", str(out)]) == 0
    assert f"plot written to {out.resolve()}" in capsys.readouterr().out
    assert out.stat().st_size > 1000
    ax = figures[0].axes[0]
    title = ax.get_title()
    for part in ("(1, 3, 4, 4, 4)", "FP32", "voxserve", server.url, socket.gethostname()):
        assert part in title
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"voxserve p50", "voxserve p99"}
    figures[0].canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert labels and all("10^" not in t and t.replace(".", "").isdigit() for t in labels)
    # --json keeps stdout for the JSON: the plot's line goes to stderr
    assert main(["bench", "--url", server.url, "--shape", "3,4,4,4", "--concurrency", "1", "--requests", "2",
                 "--plot", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)
    assert "plot written to" in captured.err
