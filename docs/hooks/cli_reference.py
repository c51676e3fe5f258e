"""mkdocs hook: the CLI reference page (cli.md), generated from the command line's own parsers at build time.

The page is never written to the source tree: ``on_files`` adds it to the build as a generated file, so it cannot
drift from ``tokenfleet.cli.build_parser()``. Every subcommand is walked recursively through its
``_SubParsersAction``; for each: usage, help, and every argument with its help, choices and default.

The service commands (``tokenfleet gateway|router|registry|decode|prefill``) hand their arguments to each service's
own parser, which is built inside the service's ``parse_args(argv)`` and has no builder of its own. That parser
is caught as it is about to parse (``ArgumentParser.parse_args`` patched for the call, nothing parsed or run), so
the page lists the services' real flags too.
"""

from __future__ import annotations

import argparse
import html
import importlib
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

from mkdocs.structure.files import File

PAGE = "cli.md"
USAGE_WIDTH = 100

# tokenfleet <service>: the module whose parse_args(argv, **kwargs) builds that service's parser
SERVICE_PARSERS = {
    "gateway": ("tokenfleet.services.gateway.main", {}),
    "router": ("tokenfleet.services.router.main", {}),
    "registry": ("tokenfleet.services.registry.main", {}),
    "decode": ("tokenfleet.services.worker.main", {"default_role": "decode"}),
    "prefill": ("tokenfleet.services.worker.main", {"default_role": "prefill"}),
}


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _raise_built(parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> argparse.Namespace:
    raise _Built(parser)


def service_parser(name: str) -> argparse.ArgumentParser:
    """The parser ``tokenfleet NAME`` hands its arguments to, caught before it parses anything."""
    module_name, kwargs = SERVICE_PARSERS[name]
    parse_args = importlib.import_module(module_name).parse_args
    with mock.patch.object(argparse.ArgumentParser, "parse_args", _raise_built):
        try:
            parse_args([], **kwargs)
        except _Built as built:
            return built.parser
    raise LookupError(f"{module_name}.parse_args built no parser")


def subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each direct subcommand, in declaration order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    yield name, helps.get(name, ""), sub


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str,
                                                                                     argparse.ArgumentParser]]:
    """(command path, help, parser) of every subcommand at every depth, depth first; services' real parsers."""
    for name, help_text, sub in subcommands(parser):
        if not path and name in SERVICE_PARSERS:
            sub = service_parser(name)
        yield (*path, name), help_text, sub
        yield from walk(sub, (*path, name))


def _text(value: str) -> str:
    """Help text as markdown: code spans kept, HTML and emphasis characters escaped outside them."""
    parts = " ".join(value.split()).split("`")
    return "`".join(part if i % 2 else html.escape(part, quote=False).replace("*", r"\*")
                    for i, part in enumerate(parts))


def _default(value: object) -> str:
    return str(value).replace(str(Path.home()), "~")  # a default under $HOME, as every reader's shell writes it


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(prog=parser.prog, width=USAGE_WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _argument(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    line = f"- `{formatter._format_action_invocation(action)}`"
    notes = []
    if action.help:
        notes.append(_text(formatter._expand_help(action)))
    if action.choices is not None and not isinstance(action.choices, dict):
        notes.append("choices: " + ", ".join(f"`{c}`" if c != "" else '`""`' for c in action.choices))
    if action.required:
        notes.append("required")
    default = action.default  # 0 is a default worth showing; None, False, "" and [] say nothing
    if not (default is None or default is False or default == [] or default in ("", argparse.SUPPRESS)) \
            and action.nargs != 0:
        notes.append(f"default: `{_default(action.default)}`")
    return line + (": " + "; ".join(notes) if notes else "")


def _section(path: tuple[str, ...], help_text: str, parser: argparse.ArgumentParser) -> list[str]:
    level = "#" * min(len(path) + 1, 4)
    lines = [f"{level} tokenfleet {' '.join(path)}", ""]
    for text in dict.fromkeys(t for t in (help_text, parser.description) if t):
        lines += [_text(text), ""]
    lines += ["```text", _usage(parser), "```", ""]
    arguments = [a for a in parser._actions if a.help != argparse.SUPPRESS
                 and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
    lines += [_argument(parser, a) for a in arguments]
    commands = [name for name, _, _ in subcommands(parser)]
    if commands:
        lines += (["", "Commands: " + ", ".join(f"`{name}`" for name in commands) + "."] if arguments
                  else ["Commands: " + ", ".join(f"`{name}`" for name in commands) + "."])
    return lines + [""]


def render() -> str:
    """The CLI reference page's markdown."""
    from tokenfleet.cli import build_parser

    parser = build_parser()
    lines = ["# CLI reference", "",
             "Every `tokenfleet` command and its flags, generated from the command line's own parsers when this "
             "site is built (`docs/hooks/cli_reference.py`), so it cannot drift from them. "
             "`tokenfleet COMMAND --help` prints the same.", "",
             "```text", _usage(parser), "```", ""]
    for path, help_text, sub in walk(parser):
        lines += _section(path, help_text, sub)
    return "\n".join(lines)


def on_files(files, config):  # mkdocs hook
    files.append(File.generated(config, PAGE, content=render()))
    return files
