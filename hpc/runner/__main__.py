"""Entry point of a sandboxed worker: `python -m hpc.runner ROLE REQUEST_FD REPLY_FD`."""

from __future__ import annotations

import sys


def main() -> None:
    role, req_fd, rep_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    from hpc.sandbox.protocol import ChannelClosed, decode_json, read_message, write_reply
    import torch

    from hpc.runner.guard import RuleViolation, warm_up
    from hpc.runner.worker import ROLES, WorkerError, dispatch

    if role == "program":
        warm_up()
    worker = ROLES[role]()
    with torch.no_grad():
        while True:
            try:
                msg = decode_json(read_message(req_fd))
            except ChannelClosed:
                return
            if msg.get("op") == "exit":
                return
            try:
                reply = dispatch(worker, msg)
            except RuleViolation as e:
                reply = {"error": str(e), "kind": "rules"}
            except WorkerError as e:
                reply = {"error": str(e), "kind": e.kind}
            write_reply(rep_fd, reply)


if __name__ == "__main__":
    main()
