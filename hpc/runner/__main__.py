"""Entry point of a sandboxed worker: `python -m hpc.runner ROLE REQUEST_FD REPLY_FD`."""

from __future__ import annotations

import sys


def main() -> None:
    role, req_fd, rep_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    from hpc.sandbox.messages import Exit, FailureKind, decode_request
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
                message = decode_json(read_message(req_fd))
            except ChannelClosed:
                return
            try:
                request = decode_request(message, role)
            except ValueError as e:
                write_reply(rep_fd, {"error": f"malformed request: {e}", "kind": FailureKind.HARNESS})
                continue
            if isinstance(request, Exit):
                return
            try:
                reply = dispatch(worker, request).to_message()
            except RuleViolation as e:
                reply = {"error": str(e), "kind": FailureKind.RULES}
            except WorkerError as e:
                reply = {"error": str(e), "kind": e.kind}
            write_reply(rep_fd, reply)


if __name__ == "__main__":
    main()
