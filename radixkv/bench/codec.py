"""``python -m radixkv.bench codec``: the tier codecs measured on size, speed, answers and load time.

Command of the committed results (``benchmarks/results/codec_cpu.txt``)::

    python -m radixkv.bench codec --out benchmarks/results/codec_cpu.txt
    python -m radixkv.bench codec --skip 1,2,3 --out benchmarks/results/codec_cpu_links.txt   # parts 4, 5

Every codec of ``radixkv.core.codec`` against raw chunks:

1. **Size and speed**: chunks of KV a model computed (a random-weight Llama, 8 layers, 8 KV
   heads of 64, ``--chunk`` tokens a chunk; the trained model of ``radixkv.bench.blend_task``, 4
   layers, 2 KV heads of 16, GQA, 64 tokens a chunk: its positions end at 256), in float16 and
   bfloat16: size against raw, and encode and decode MB/s of KV on one core
   (``torch.set_num_threads(1)``; medians), decoding with the extension where it is built.
2. **Answers on random weights**: prompts prefilled, their KV put through the codec chunk by chunk
   as a tier would store it, then the next token and a greedy continuation from the coded KV against
   the raw KV's: max |logit difference|, KL(raw || coded) of the next token, the first token equal,
   and the share of the continuation equal up to its first difference.
3. **Answers on the trained model** (``blend_task.trained``: trained here once, then loaded from
   ``~/.cache/radixkv``): its prompts' KV coded in 16-token chunks (its prompts are 40-90 tokens;
   the share coded is reported, and a prompt with no whole chunk stops the run), answer accuracy on
   conflicting and single questions with raw and with each codec, how often the answer equals raw
   KV's, and KL(raw || coded) of the answer's logits.
4. **Load time of a prefix from S3** (moto's server on loopback, then behind a proxy throttled to
   1 Gbit/s and to 100 MB/s): the lookup and load of a ``--prefix``-token prefix of an 8-layer,
   8-KV-head, 128-dim float16 model (32 KiB a token; a random-weight Llama of that shape computed
   it), raw against each codec; medians of ``--repeat`` cold loads, each checked to load every
   chunk.
5. **Load time of a prefix from a peer** (``peer_codec``): the same prefix in one instance's CPU
   tier (raw, as CPU tiers are), served over pyzmq through the same proxy to a reader that asks
   for each codec, so the serving instance codes it on request (``radixkv.p2p.node.Recoder``):
   each load once with the coding (the server's coded blobs dropped before it) and once with the
   coded blobs the server kept; raw is the plain read.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import uuid
from typing import Any, Callable

import torch

from radixkv.bench import Report, out_file
from radixkv.tools._args import Parser

NAMES = ("none", "zstd", "int8", "cachegen")


def _chunks(kv: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """``[layers, sides, tokens, heads, dim]`` KV cut into ``chunk``-token chunks (whole ones)."""
    return [kv[:, :, i:i + chunk].contiguous() for i in range(0, kv.shape[2] - chunk + 1, chunk)]


def _roundtrip(kv: torch.Tensor, name: str, chunk: int) -> torch.Tensor:
    """``kv`` as a reader gets it back from a tier written with codec ``name``, chunk by chunk
    (a partial last chunk stays raw, as the pool keeps it)."""
    from radixkv.core.format import decode_chunk, encode_chunk

    out = kv.clone()
    for i in range(0, kv.shape[2] - chunk + 1, chunk):
        piece = kv[:, :, i:i + chunk].contiguous()
        tokens = bytes(4 * chunk)
        blob = encode_chunk(bytes(8), bytes(16), bytes(16), tokens, piece, codec=name)
        out[:, :, i:i + chunk] = decode_chunk(blob, namespace_id=bytes(8), key=bytes(16), parent_key=bytes(16),
                                              tokens=tokens, dtype=piece.dtype, shape=piece.shape)
    return out


def _model_kv(model: Any, tokens: list[int]) -> torch.Tensor:
    """The KV of ``tokens`` (``[layers, 2, tokens, kv heads, head_dim]``) from one prefill."""
    with torch.no_grad():
        cache = model(input_ids=torch.tensor(tokens)[None], use_cache=True).past_key_values
    return torch.stack([torch.stack([layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)])
                        for layer in cache.layers])


def _with_kv(model: Any, kv: torch.Tensor) -> Any:
    """A ``DynamicCache`` holding ``kv`` (as ``_model_kv`` gives it)."""
    import transformers

    cache = transformers.DynamicCache()
    for i, layer in enumerate(kv):
        cache.update(layer[0].transpose(0, 1)[None].contiguous(), layer[1].transpose(0, 1)[None].contiguous(), i)
    return cache


def _continue(model: Any, kv: torch.Tensor, last: int, new: int) -> tuple[torch.Tensor, list[int]]:
    """From cached ``kv`` and the prompt's last token: its next-token logits and ``new`` greedy tokens."""
    cache, token, out, first = _with_kv(model, kv), last, [], None
    with torch.no_grad():
        for _ in range(new):
            logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]
            first = logits.float() if first is None else first
            token = int(logits.argmax())
            out.append(token)
    assert first is not None
    return first, out


def _random_model(dtype: torch.dtype, hidden: int = 512) -> Any:
    """A random-weight Llama of 8 layers and 8 heads (all KV heads: ``hidden / 8`` wide)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                                      max_position_embeddings=4096)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype).train(False)


def _table(report: Report, head: list[str], rows: list[list[str]]) -> None:
    report("| " + " | ".join(head) + " |")
    report("| --- |" + " ---: |" * (len(head) - 1))
    for row in rows:
        report("| " + " | ".join(row) + " |")
    report()


def _mb_s(nbytes: int, fn: Callable[[], object], repeat: int) -> float:
    from radixkv.bench import median_seconds

    return nbytes / median_seconds(fn, repeat=repeat) / 1e6


def size_and_speed(report: Report, models: list[tuple[str, Any, int]], repeat: int) -> None:
    """Part 1."""
    from radixkv.core.codec import get_codec

    from radixkv.core import ops

    report(f"## 1. size and speed: chunks of a model's KV; MB/s of KV on one core (torch threads 1), medians "
           f"of {repeat}; decode with the {ops.backend()} backend (cpp: the extension's one-pass dequantize)")
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for label, model, size in models:
            for dtype in (torch.float16, torch.bfloat16):
                rng = random.Random(1)
                tokens = [rng.randrange(model.config.vocab_size) for _ in range(4 * size)]
                kv = _model_kv(model.to(dtype), tokens)
                chunks = _chunks(kv, size)
                raw = sum(c.numel() * c.element_size() for c in chunks)
                for name in NAMES[1:]:
                    codec = get_codec(name)
                    maybe = [codec.encode(c) for c in chunks]
                    coded = [c for c in maybe if c is not None]
                    if len(coded) < len(maybe):
                        rows.append([label, str(size), str(dtype).removeprefix("torch."), name, "raw", "-", "-"])
                        continue
                    coded_bytes = sum(len(p) for _, p in coded)
                    enc = _mb_s(raw, lambda: [codec.encode(c) for c in chunks], repeat)
                    dec = _mb_s(raw, lambda: [codec.decode(memoryview(p), q, c.dtype, tuple(c.shape), None)
                                              for (q, p), c in zip(coded, chunks)], repeat)
                    rows.append([label, str(size), str(dtype).removeprefix("torch."), name, f"{raw / coded_bytes:.2f}x",
                                 f"{enc:.0f}", f"{dec:.0f}"])
            model.to(torch.float32)
    finally:
        torch.set_num_threads(threads)
    _table(report, ["KV of", "chunk tokens", "dtype", "codec", "smaller than raw", "encode MB/s", "decode MB/s"],
           rows)


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.float(), -1)
    q = torch.log_softmax(q_logits.float(), -1)
    return float((p.exp() * (p - q)).sum())


def _agreement(a: list[int], b: list[int]) -> float:
    same = 0
    for x, y in zip(a, b):
        if x != y:
            break
        same += 1
    return same / len(a)


def answers_random(report: Report, model: Any, chunk: int, prompts: int, length: int, new: int) -> None:
    """Part 2."""
    report(f"## 2. answers on random weights (Llama, 8 layers, 8 KV heads of 64, float16 KV): "
                f"{prompts} prompts of {length} tokens, KV coded in {chunk}-token chunks, {new} greedy tokens")
    rng = random.Random(2)
    results: dict[str, list[tuple[float, float, bool, float]]] = {name: [] for name in NAMES}
    for _ in range(prompts):
        tokens = [rng.randrange(model.config.vocab_size) for _ in range(length)]
        kv = _model_kv(model, tokens[:-1]).to(torch.float16)
        base_logits, base = _continue(model, kv.float(), tokens[-1], new)
        for name in NAMES:
            logits, got = _continue(model, _roundtrip(kv, name, chunk).float(), tokens[-1], new)
            results[name].append((float((logits - base_logits).abs().max()), _kl(base_logits, logits),
                                  got[0] == base[0], _agreement(base, got)))
    rows = []
    for name, rs in results.items():
        rows.append([name, f"{statistics.median(r[0] for r in rs):.3g}", f"{max(r[0] for r in rs):.3g}",
                     f"{statistics.median(r[1] for r in rs):.2e}", f"{sum(r[2] for r in rs) / len(rs):.1%}",
                     f"{statistics.mean(r[3] for r in rs):.1%}"])
    _table(report, ["codec", "max abs logit diff, median", "worst", "KL(raw ‖ coded) median", "first token = raw's",
                  "continuation = raw's"], rows)


def answers_trained(report: Report, model: Any, chunk: int, questions: int, seed: int) -> None:
    """Part 3."""
    from radixkv.bench.blend_task import Corpus

    corpus, rng = Corpus(24, seed + 1), random.Random(seed + 2)
    asked = [corpus.question(rng, rng.randint(2, 6), i % 2 == 0) for i in range(questions)]
    report(f"## 3. answers on the trained model (blend_task, seed {seed}): {questions} questions "
                f"(half conflicting), the prompt's KV coded in {chunk}-token chunks, float32 KV as float16")
    coded = [len(q.tokens[:-1]) // chunk * chunk / len(q.tokens[:-1]) for q in asked]
    if min(coded) == 0:
        raise RuntimeError(f"a question of {min(len(q.tokens) for q in asked)} tokens has no whole {chunk}-token "
                           f"chunk: its row would not measure a codec")
    report(f"(the prompts are {min(len(q.tokens) for q in asked)}-{max(len(q.tokens) for q in asked)} tokens; "
           f"{statistics.mean(coded):.0%} of their KV, in whole chunks, goes through the codec)")
    rows = []
    raw_answers: list[int] = []
    for name in NAMES:
        right = {True: 0, False: 0}
        same, kls = 0, []
        for i, q in enumerate(asked):
            kv = _model_kv(model, q.tokens[:-1]).to(torch.float16)
            logits, _ = _continue(model, _roundtrip(kv, name, chunk).float(), q.tokens[-1], 1)
            answer = int(logits.argmax())
            if name == "none":
                raw_answers.append(answer)
                raw_logits = logits
            else:
                raw_logits, _ = _continue(model, kv.float(), q.tokens[-1], 1)
            right[i % 2 == 0] += answer == q.answer
            same += answer == raw_answers[i]
            kls.append(_kl(raw_logits, logits))
        half = questions / 2
        rows.append([name, f"{right[True] / half:.1%}", f"{right[False] / half:.1%}", f"{same / questions:.1%}",
                     f"{statistics.median(kls):.2e}", f"{max(kls):.2e}"])
    _table(report, ["codec", "conflicting right", "single right", "answer = raw's", "KL(raw ‖ coded) median", "worst"],
                 rows)


#: The links parts 4 and 5 load through: (label, the proxy's mode, its rate in bytes a second).
LINKS = (("loopback", "pass", 0.0), ("1 Gbit/s", "throttle", 125e6), ("100 MB/s", "throttle", 100e6))


def _prefix_kv(prefix: int, seed: int) -> tuple[Any, list[int], torch.Tensor]:
    """Parts 4 and 5: the layout (8 layers, 8 KV heads of 128, float16), a ``prefix``-token prompt
    and its KV, computed by a random-weight Llama of that shape."""
    from radixkv.core.pool import KVLayout

    layout = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype=torch.float16, page_size=16)
    model = _random_model(torch.float32, hidden=1024)
    rng = random.Random(seed)
    tokens = [rng.randrange(4096) for _ in range(prefix)]
    return layout, tokens, _model_kv(model, tokens).to(torch.float16)          # [8, 2, prefix, 8, 128]


def load_times(report: Report, prefix: int, chunk: int, repeat: int) -> None:
    """Part 4."""
    from radixkv.backends.s3 import S3Tier
    from radixkv.core.hashing import Namespace
    from radixkv.core.stack import TierStack
    from radixkv.testing.proxy import FaultyProxy
    from radixkv.tools.s3server import moto_with_bucket

    layout, tokens, kv = _prefix_kv(prefix, 4)
    report(f"## 4. load time of a {prefix}-token prefix from S3 (moto on loopback; behind a proxy throttled to "
                f"a shared link), KV of an 8-layer, 8-KV-head, 128-dim float16 model ({layout.token_bytes // 1024} "
                f"KiB a token; the KV of a random-weight Llama of that shape), {chunk}-token chunks, median of {repeat} "
                f"cold loads (lookup, fetch, verify, decode)")
    rows = []
    with moto_with_bucket("radixkv-codec-bench") as server:
        host, port = server.endpoint_url.removeprefix("http://").split(":")
        with FaultyProxy((host, int(port)), mode="pass") as proxy:
            for name in NAMES:
                ns = Namespace(model=f"bench-{uuid.uuid4().hex[:8]}").bind(layout)
                tier = S3Tier("radixkv-codec-bench", "b", endpoint_url=proxy.url)
                stack = TierStack([tier], namespace=ns, layout=layout, chunk_size=chunk, codecs=[name],
                                  timeout_s=120.0)
                refs = stack.refs(tokens)
                stack.store([(r, c) for r, c in zip(refs, _chunks(kv, chunk))])
                stack.flush()
                stored = stack.stats()["tier_bytes_stored"][0]
                row = [name, f"{stored / 2**20:.1f}"]
                for _, mode, rate in LINKS:
                    proxy.mode = mode
                    proxy.rate_bytes_s = rate or 1e12

                    def load() -> None:
                        got = stack.load(refs, deadline=time.monotonic() + 120)
                        if len(got) != len(refs):
                            raise RuntimeError(f"{name}: {len(got)} of {len(refs)} chunks loaded: the row would "
                                               f"not measure a hit")

                    row.append(f"{statistics.median(_timed(load) for _ in range(repeat)) * 1e3:.0f}")
                proxy.mode = "pass"
                stack.close()
                rows.append(row)
    _table(report, ["codec", "stored MiB", *[f"{label} (ms)" for label, _, _ in LINKS]], rows)


def peer_load_times(report: Report, prefix: int, chunk: int, repeat: int) -> None:
    """Part 5."""
    import secrets

    from radixkv.backends.cpu import CpuTier
    from radixkv.core.hashing import Namespace
    from radixkv.core.stack import TierStack
    from radixkv.p2p.controller import Controller, ControllerClient
    from radixkv.p2p.node import join
    from radixkv.p2p.tier import PeerTier
    from radixkv.testing.proxy import FaultyProxy

    layout, tokens, kv = _prefix_kv(prefix, 5)
    report(f"## 5. load time of a {prefix}-token prefix from a peer's CPU tier (pyzmq through a proxy on loopback, "
           f"then throttled as in part 4), the model of part 4, {chunk}-token chunks, median of {repeat} loads "
           f"(lookup, fetch, verify, decode): 'coded on request' with the server's coded blobs dropped before each "
           f"load, 'kept' with them kept (a hot prefix: coded once for every reader)")
    secret = secrets.token_hex(16)
    ns = Namespace(model=f"bench-peer-{uuid.uuid4().hex[:8]}").bind(layout)
    rows = []
    with Controller("tcp://127.0.0.1:0", secret) as controller:
        cpu = CpuTier(4 * prefix * layout.token_bytes)
        tiers, node = join([cpu], ns, controller=controller.address, secret=secret, instance="server",
                           address="tcp://127.0.0.1:0", transport="zmq", timeout_s=120.0)
        server = TierStack(tiers, namespace=ns, layout=layout, chunk_size=chunk, secret=secret, timeout_s=120.0)
        node.watch(server)
        host, port = node.endpoint.removeprefix("tcp://").split(":")
        with FaultyProxy((host, int(port)), mode="pass") as proxy:
            node.endpoint = f"tcp://127.0.0.1:{proxy.port}"       # readers reach the server through the proxy
            node.start()
            refs = server.refs(tokens)
            server.store([(r, c) for r, c in zip(refs, _chunks(kv, chunk))], tiers=[0])
            server.flush()
            keys = [ns.id + r.key for r in refs]
            asker = ControllerClient(controller.address, secret)
            deadline = time.monotonic() + 30
            while asker.lookup(keys).get("server", 0) < len(keys):     # the controller has the holdings
                if time.monotonic() > deadline:
                    raise RuntimeError("the controller never saw the server's chunks")
                time.sleep(0.05)
            asker.close()
            recoder = node.server.recoder if node.server is not None else None
            assert recoder is not None
            for name in NAMES:
                peer = PeerTier(controller.address, secret, instance=f"reader-{name}", transport="zmq",
                                timeout_s=120.0, codec=name)
                reader = TierStack([peer], namespace=ns, layout=layout, chunk_size=chunk, secret=secret,
                                   timeout_s=120.0, promote=False)
                before = peer.stats()["bytes_read"]

                def load() -> None:
                    where = reader.lookup([r.key for r in refs], deadline=time.monotonic() + 120)
                    got = reader.load(refs[:len(where)], where=where, deadline=time.monotonic() + 120)
                    if len(got) != len(refs):
                        raise RuntimeError(f"{name}: {len(got)} of {len(refs)} chunks loaded from the peer: the "
                                           f"row would not measure a hit")

                load()
                sent = peer.stats()["bytes_read"] - before
                row = [name, f"{sent / 2**20:.1f}"]
                for _, mode, rate in LINKS:
                    proxy.mode = mode
                    proxy.rate_bytes_s = rate or 1e12

                    def cold() -> None:
                        recoder.clear()
                        load()

                    if name != "none":
                        row.append(f"{statistics.median(_timed(cold) for _ in range(repeat)) * 1e3:.0f}")
                    else:
                        row.append("-")
                    row.append(f"{statistics.median(_timed(load) for _ in range(repeat)) * 1e3:.0f}")
                proxy.mode = "pass"
                reader.close()
                rows.append(row)
        server.close()
    head = ["codec", "sent MiB"]
    for label, _, _ in LINKS:
        head += [f"{label}: coded on request (ms)", f"{label}: kept (ms)"]
    _table(report, head, rows)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    """``python -m radixkv.bench codec``: the five parts of the module docstring, less those in ``--skip``;
    0.  Cost: part 3 trains its model on a machine's first run (``--steps`` steps, then loaded from
    ``~/.cache/radixkv``); parts 4 and 5 start moto's S3 server, a throttled proxy and a serving peer,
    and time ``--repeat`` cold loads of a ``--prefix``-token prefix per codec and link."""
    parser = Parser(prog="python -m radixkv.bench codec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk", type=int, default=256, help="tokens per chunk (default 256)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=12, help="random-weight prompts of part 2")
    parser.add_argument("--length", type=int, default=1024, help="their tokens")
    parser.add_argument("--new", type=int, default=16, help="greedy tokens of part 2")
    parser.add_argument("--questions", type=int, default=200, help="trained-model questions of part 3")
    parser.add_argument("--seed", type=int, default=0, help="the trained model's seed")
    parser.add_argument("--steps", type=int, default=2000, help="the trained model's training steps")
    parser.add_argument("--prefix", type=int, default=2048, help="tokens of part 4's prefix")
    parser.add_argument("--skip", default="", help="parts to leave out, e.g. 3,4")
    parser.add_argument("--out", type=out_file, help="also write the report to this file")
    args = parser.parse_args(argv)
    skip = {int(p) for p in args.skip.split(",") if p}
    report = Report("codec", argv)
    random_model = _random_model(torch.float32)
    trained = None
    if 3 not in skip:           # trained once per machine, then loaded
        from radixkv.bench.blend_task import trained as load_trained

        trained = load_trained(args.steps, seed=args.seed, log=report)
    if 1 not in skip:
        models = [("random Llama 8x8x64", random_model, args.chunk)]
        if trained is not None:              # its prompts are short: 64-token chunks, 256 tokens in all
            models.append(("trained 4x2x16", trained, min(args.chunk, 64)))
        size_and_speed(report, models, args.repeat)
    if 2 not in skip:
        answers_random(report, random_model, args.chunk, args.prompts, args.length, args.new)
    if 3 not in skip and trained is not None:
        answers_trained(report, trained, 16, args.questions, args.seed)
    if 4 not in skip:
        load_times(report, args.prefix, args.chunk, args.repeat)
    if 5 not in skip:
        peer_load_times(report, args.prefix, args.chunk, args.repeat)
    report.save(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

