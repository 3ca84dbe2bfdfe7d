"""The command and environment of a deploy/docker-compose.yml service, for hosts without Docker.

    python deploy/compose_command.py prefill --env-file deploy/pdserve.env          # print it
    python deploy/compose_command.py prefill --env-file deploy/pdserve.env --exec   # run it here

Variables are interpolated as compose does it (${VAR}, ${VAR:-default}, ${VAR-default},
${VAR:?message}, ${VAR?message}, $$; no nesting), the shell's environment winning over the env
file. Env
file lines are KEY=VALUE, taken literally (no quotes), `#` starts a comment line. `python3` in
the command is the first python3 on PATH: a venv's when it is activated. Needs PyYAML.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

import yaml

COMPOSE_FILE = Path(__file__).resolve().parent / "docker-compose.yml"
_VAR = re.compile(r"\$(?:(\$)|\{([^}$]*)\}|([A-Za-z_][A-Za-z0-9_]*)|)")
_BRACED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])(.*))?", re.S)


class ComposeError(ValueError):
    """A required variable is unset, or the file uses what this reader does not know."""


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ComposeError(f"{path}:{n}: expected KEY=VALUE")
        env[key.strip()] = value
    return env


def interpolate(text: str, env: dict[str, str]) -> str:
    def one(m: re.Match) -> str:
        escaped, braced, plain = m.groups()
        if escaped:
            return "$"
        if plain:
            return env.get(plain, "")
        if braced is None:
            raise ComposeError(f"{text!r}: a lone $ (write $$ for a literal one)")
        parts = _BRACED.fullmatch(braced)
        if parts is None:
            raise ComposeError(f"${{{braced}}}: unsupported substitution")
        name, op, arg = parts.groups()
        value = env.get(name)
        unset = value is None or (op is not None and op.startswith(":") and value == "")
        if op in ("-", ":-"):
            return interpolate(arg, env) if unset else value
        if op in ("?", ":?"):
            if unset:
                raise ComposeError(f"{name}: {arg or 'required'}")
            return value
        return value or ""

    return _VAR.sub(one, text)


def _resolve(node, env: dict[str, str]):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_resolve(x, env) for x in node]
    if isinstance(node, dict):
        return {k: _resolve(v, env) for k, v in node.items()}
    return node


def load_service(
    name: str, env: dict[str, str], compose_file: Path = COMPOSE_FILE
) -> tuple[list[str], dict[str, str]]:
    """(command argv, environment) of service `name`, interpolated with `env`."""
    doc = yaml.safe_load(compose_file.read_text())
    # The whole file, as compose does: a required variable is required by every service.
    services = _resolve(doc["services"], env)
    _resolve(doc.get("volumes") or {}, env)
    if name not in services:
        raise ComposeError(f"no service {name!r} (there are: {', '.join(services)})")
    service = services[name]
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.partition("=")[::2] for item in environment)
    return [str(a) for a in service["command"]], {k: str(v) for k, v in environment.items()}


def shell_lines(argv: list[str], environment: dict[str, str]) -> str:
    """`export` lines, then the command with one flag (and its values) per line."""
    lines = [f"export {k}={shlex.quote(v)}" for k, v in environment.items()]
    groups: list[list[str]] = []
    for arg in argv:
        if not groups or arg.startswith("--"):
            groups.append([])
        groups[-1].append(shlex.quote(arg))
    cmd = " \\\n  ".join(" ".join(g) for g in groups)
    return "\n".join([*lines, cmd])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python deploy/compose_command.py", description=__doc__)
    ap.add_argument("service", help="prefill, decode or router")
    ap.add_argument("--env-file", type=Path, help="KEY=VALUE lines (the shell's env wins)")
    ap.add_argument("--compose-file", type=Path, default=COMPOSE_FILE)
    ap.add_argument("--exec", action="store_true", help="run the command in place of this one")
    args = ap.parse_args(argv)
    env = {**(read_env_file(args.env_file) if args.env_file else {}), **os.environ}
    try:
        command, environment = load_service(args.service, env, args.compose_file)
    except ComposeError as e:
        sys.exit(f"error: {e}")
    if args.exec:
        os.execvpe(command[0], command, {**os.environ, **environment})
    print(shell_lines(command, environment))


if __name__ == "__main__":
    main()
