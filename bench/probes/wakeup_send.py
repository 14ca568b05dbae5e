"""What one small send on a Unix stream socket costs the sender, with the reader busy and with the reader asleep.

An engine answers each front end with one send per loop iteration (server/topology/ipc.py ``Outbox``); a front
end's reader thread sleeps in recv between replies, so most sends also wake it. This measures the sender's time in
``send`` for a reply-sized message, back to back (the reader never sleeps long) and with a pause before each send
(the reader is asleep in recv when it comes), the reader being another process.

    python bench/probes/wakeup_send.py [--sends 4000] [--pause-us 200] [--bytes 96]
"""

from __future__ import annotations

import argparse
import os
import socket
import time


def per_send_us(sock: socket.socket, message: bytes, sends: int, pause_s: float) -> float:
    spent = 0.0
    for _ in range(sends):
        if pause_s:
            time.sleep(pause_s)
        start = time.perf_counter()
        sock.send(message)
        spent += time.perf_counter() - start
    return spent / sends * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sends", type=int, default=4000)
    parser.add_argument("--pause-us", type=float, default=200.0)
    parser.add_argument("--bytes", type=int, default=96, help="message size (a batch-1 reply: 32 + 64 bytes)")
    args = parser.parse_args()
    sender, reader = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # the reader: blocks in recv whenever nothing is queued
        sender.close()
        while reader.recv(1 << 16):
            pass
        os._exit(0)
    reader.close()
    message = b"\0" * args.bytes
    per_send_us(sender, message, 200, 0.0)  # warm-up
    busy = per_send_us(sender, message, args.sends, 0.0)
    asleep = per_send_us(sender, message, args.sends, args.pause_us / 1e6)
    sender.close()
    os.waitpid(pid, 0)
    print(f"{os.cpu_count()} CPUs; {args.bytes}-byte sends, {args.sends} each way")
    print(f"| reader | us per send |\n|---|---:|\n| busy (sends back to back) | {busy:.1f} |\n"
          f"| asleep in recv ({args.pause_us:.0f} us pause before each send) | {asleep:.1f} |")


if __name__ == "__main__":
    main()
