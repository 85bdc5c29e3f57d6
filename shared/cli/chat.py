"""`pdserve chat`: an interactive conversation with the served model, streamed, history kept.

Each line read is a user turn; the reply streams to stdout (one line per reply), the conversation so far goes with
every request (rendered by the router with the model's chat template). A reasoning model's thinking streams to
stderr (`--hide-reasoning` drops it) and is not sent back as history. Commands: `/reset` (forget the history, keep
the system prompt), `/exit`. End of input (Ctrl-D, or the end of piped input) ends the session; Ctrl-C during a
reply stops that reply (the turn is dropped), at the prompt it ends the session.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from pdserve.cli.client_args import add_client_args, add_target_arg, client_options

DEFAULT_MAX_TOKENS = 512  # a reply's cap: a model looping at temperature 0 stops here, not at the context's end
MODEL_DEFAULT = "default: the model's generation_config.json, else pdserve's (temperature 1.0, top_p 1.0, top_k off)"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve chat", description="Chat with the served model (streamed, history kept).")
    add_target_arg(p)
    p.add_argument("--system", default="", help="system prompt (kept across /reset)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help=f"most tokens per reply (default: {DEFAULT_MAX_TOKENS}, less when the context left is shorter)",
    )
    p.add_argument("--temperature", type=float, default=None, help=MODEL_DEFAULT)
    p.add_argument("--top-p", type=float, default=None, help=MODEL_DEFAULT)
    p.add_argument("--top-k", type=int, default=None, help=MODEL_DEFAULT)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-reasoning-tokens", type=int, default=None, help="reasoning models: thinking budget")
    p.add_argument("--hide-reasoning", action="store_true", help="do not print a reasoning model's thinking")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument(
        "--model", default="", help="the served model to use (default: the router's only one; several served: name one)"
    )
    add_client_args(p)  # --token, --tls-ca, --tls
    return p.parse_args(argv)


def _read_line(stdin: TextIO, stderr: TextIO, interactive: bool) -> str | None:
    """The next user line, None at end of input."""
    if interactive:
        stderr.write("you> ")
        stderr.flush()
    line = stdin.readline()
    return None if line == "" else line.rstrip("\n")


def run_chat(
    args: argparse.Namespace, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr
) -> int:
    import grpc

    from pdserve.client import Client

    interactive = stdin.isatty()
    base = [{"role": "system", "content": args.system}] if args.system else []
    history = list(base)
    sampling = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_reasoning_tokens=args.max_reasoning_tokens,
        model=args.model,
    )
    with Client(args.target, timeout=args.timeout, **client_options(args)) as client:
        while True:
            try:
                line = _read_line(stdin, stderr, interactive)
            except KeyboardInterrupt:
                line = None
            if line is None or line.strip() == "/exit":
                if interactive:
                    stderr.write("\n")
                return 0
            if line.strip() == "/reset":
                history = list(base)
                stderr.write("[history cleared]\n")
                continue
            if not line.strip():
                continue
            turn = [*history, {"role": "user", "content": line}]
            answer: list[str] = []
            thinking = False
            try:
                for chunk in client.chat(turn, stream=True, **sampling):
                    if chunk.reasoning_text and not args.hide_reasoning:
                        stderr.write(("" if thinking else "[thinking] ") + chunk.reasoning_text)
                        stderr.flush()
                        thinking = True
                    if chunk.text:
                        if thinking:
                            stderr.write("\n")
                            thinking = False
                        stdout.write(chunk.text)
                        stdout.flush()
                        answer.append(chunk.text)
            except KeyboardInterrupt:
                stdout.write("\n")
                stderr.write("[reply interrupted; turn dropped]\n")
                continue
            except grpc.RpcError as e:
                stdout.write("\n")
                stderr.write(f"error: {e.code().name}: {e.details()}\n")
                continue
            stdout.write("\n")
            stdout.flush()
            history = [*turn, {"role": "assistant", "content": "".join(answer)}]


def cmd_chat(argv: list[str]) -> int:
    return run_chat(parse_args(argv))
