"""The documentation's commands run as written: every ``radixkv_config`` a docs page or the README
gives vLLM is one the connector accepts, and every ``python -m radixkv route`` command line in them
parses, with the model directory it names, into a router."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs" / "pages").glob("*.md")) + [ROOT / "README.md"]


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def _commands(block: str) -> list[str]:
    """The block's commands: continuation lines (a trailing backslash, or a quote still open)
    joined, comments dropped."""
    out, current = [], ""
    for line in block.splitlines():
        if not current and line.lstrip().startswith("#"):
            continue
        if current.count("'") % 2 == 0:
            line = re.sub(r"\s+#\s.*$", "", line)          # a trailing comment, outside quotes
        if line.endswith("\\"):
            current += line[:-1] + " "
        elif (current + line).count("'") % 2:             # inside a quoted argument: go on
            current += line + " "
        else:
            current += line
            if current.strip():
                out.append(current.strip())
            current = ""
    return out


@pytest.mark.slow                 # imports vLLM (tens of seconds)
def test_every_radixkv_config_given_to_vllm_is_accepted() -> None:
    from radixkv.integrations.vllm import connector_config

    found = 0
    for page in PAGES:
        for block in _bash_blocks(page.read_text()):
            for command in _commands(block):
                if "--kv-transfer-config" not in command:
                    continue
                args = shlex.split(command)
                transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
                extra = transfer.get("kv_connector_extra_config", {})
                block_size = int(args[args.index("--block-size") + 1]) if "--block-size" in args else 16
                connector_config(extra, block_size=block_size, model="docs-model")
                found += 1
    assert found >= 2, "the docs show vLLM with radixkv's connector"


def test_every_route_command_parses_into_a_router(tmp_path: Path) -> None:
    pytest.importorskip("aiohttp")
    from radixkv.fleet.router import Router, model_limits
    from radixkv.tools.cli import _parser

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 256, "max_position_embeddings": 1024}))
    found = 0
    for page in PAGES:
        for block in _bash_blocks(page.read_text()):
            for command in _commands(block):
                if not command.startswith("python -m radixkv route"):
                    continue
                argv = [str(model) if a == "DIR" else a for a in shlex.split(command)[3:]]
                args = _parser().parse_args(argv)
                vocab, context = model_limits(args.model_config or args.tokenizer,
                                              required=args.model_config is not None)
                Router(args.backend, policy=args.policy, block_size=args.block_size, hash_algo=args.hash_algo,
                       vocab_size=args.vocab_size or vocab, max_model_len=args.max_model_len or context)
                found += 1
    assert found >= 1, "the docs show the router's command"
