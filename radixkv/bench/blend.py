"""``python -m radixkv.bench blend``: CacheBlend measured against full prefill on RAG prompts.

Command of the committed results (``benchmarks/results/blend_cpu.txt``)::

    python -m radixkv.bench blend --out benchmarks/results/blend_cpu.txt

Prompts are a system prompt, ``k`` of ``n`` documents in random order (``k = 2 .. 6``) and a
question.  Every document's KV was computed on its own and stored in a CPU tier (a segment cache);
the system prompt was computed once by an exact request and is pinned in the pool.  Each prompt is
served by the reference paged engine:

* ``full``: full prefill, nothing reused (on a cache that holds nothing);
* ``prefix``: prefix caching (the system prompt from the pool, everything after it computed);
* ``r=...``: CacheBlend with recompute ratio ``r`` (0: naive reuse, 1: every token recomputed),
  the system prompt from the pool, the documents loaded from the tier, moved to their positions
  and blended.

Every row is checked before it is compared: each request but full prefill's must have taken the
system prompt's full pages from the cache, and full prefill's none (the benchmark stops otherwise).

Part 1, a random-weight Llama (8 layers, hidden 256, GQA): TTFT (median over the prompts; the
admission's tier loads and the prefill, up to the first token), and against full prefill the
last-token logits (max |difference|, KL(full || blended)) and the greedy continuation (first
token equal; share of the continuation equal up to the first difference).  Part 2, the model of
``radixkv.bench.blend_task`` trained here (4 layers; ranked documents that disagree: a
conflicting question's answer depends on two documents at once): answer accuracy (greedy) on
conflicting and on single questions, agreement with full prefill's answer and KL(full || method)
of the answer's logits, with full prefill, prefix caching and each ``r``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from radixkv.bench import Report, out_file
from radixkv.tools._args import Parser

RATIOS = (0.0, 0.05, 0.15, 0.30, 1.0)


def _engine_cache(model: Any, pinned: list[int], tiers: bool) -> Any:
    """A cache for one method; with ``pinned`` (the system prompt), that prompt is computed once by
    an exact request and pinned, and the pin is checked to hold all its full pages: the baseline
    must really hit before it is compared (``pin`` keeps only what is cached already)."""
    import radixkv as rk
    from radixkv.backends import CpuTier
    from radixkv.integrations.paged import PagedEngine
    from radixkv.integrations.transformers import layout_for, namespace_for

    layout = layout_for(model, page_size=16)
    cache = rk.PrefixCache(layout, num_pages=512, namespace=namespace_for(model),
                           chunk_size=64, tiers=[CpuTier(256 << 20)] if tiers else ())
    if pinned:
        engine = PagedEngine(model, cache)
        engine.add([*pinned, pinned[-1]], 1)        # the prompt's full pages, computed exactly and cached
        engine.run()
        held = cache.pin(pinned)
        want = len(pinned) // layout.page_size * layout.page_size
        if held != want:
            raise RuntimeError(f"the pinned system prompt holds {held} tokens, not its {want}: the "
                               f"prefix-caching baseline would not hit")
    return cache


def _check_hit(name: str, req: Any, system: list[int], page_size: int) -> None:
    """Every method but full prefill takes the system prompt's full pages from the cache."""
    want = 0 if name == "full" else len(system) // page_size * page_size
    if req.cached_at_start[0] < want or (name == "full" and req.cached_at_start[0]):
        raise RuntimeError(f"{name}: {req.cached_at_start[0]} prompt tokens came from the cache, expected "
                           f"{'none' if name == 'full' else f'at least {want}'}")


def _serve(model: Any, cache: Any, prompt: list[int], spans: list[tuple[int, int]], new: int,
           ratio: float | None, segments: Any = None) -> tuple[Any, float]:
    """Serve one prompt; the request and its TTFT (seconds: admission, loads and prefill)."""
    from radixkv.reuse.blend import Blend
    from radixkv.integrations.paged import PagedEngine

    blend = None if ratio is None else Blend(ratio=ratio, store_missing=False)
    engine = PagedEngine(model, cache, keep_logits=True, blend=blend, segments=segments)
    t0 = time.perf_counter()
    req = engine.add(prompt, new, segments=spans if blend is not None else ())
    while not req.output:
        engine.step()
    ttft = time.perf_counter() - t0
    engine.run()
    return req, ttft


def _compare(req: Any, full: Any) -> tuple[float, float, bool, float]:
    """Max |logit difference|, KL(full || this), first token equal, share of the continuation
    equal up to the first difference."""
    a, b = full.logits[0].double(), req.logits[0].double()
    kl = float((a.softmax(-1) * (a.log_softmax(-1) - b.log_softmax(-1))).sum())
    same = 0
    for x, y in zip(full.output, req.output):
        if x != y:
            break
        same += 1
    return float((a - b).abs().max()), kl, full.output[0] == req.output[0], same / len(full.output)


def _methods() -> list[tuple[str, float | None]]:
    return [("full", None), ("prefix", None)] + [(f"r={r:.0%}" if r not in (0, 1) else
                                                  ("r=0 (naive)" if r == 0 else "r=100%"), r) for r in RATIOS]


def random_weights(report: Report, prompts_per_k: int, n_docs: int, new: int, seed: int) -> None:
    """Part 1: TTFT and deviation from full prefill on a random-weight model."""
    from radixkv.integrations.paged_blend import segment_kv
    from radixkv.integrations.transformers import random_model
    from radixkv.reuse.segments import SegmentCache

    model = random_model("llama", seed=seed, num_layers=8, hidden_size=256, num_heads=8, num_kv_heads=2,
                         vocab_size=1024, max_positions=4096)
    rng = random.Random(seed)
    system = [rng.randrange(3, 1024) for _ in range(64)]
    docs = [[rng.randrange(3, 1024) for _ in range(rng.randint(96, 160))] for _ in range(n_docs)]
    shared = _engine_cache(model, system, tiers=True)
    segments = SegmentCache(shared.stack)
    for doc in docs:
        segments.store(doc, segment_kv(model, doc, torch.float32))
    shared.flush()
    report(f"## random weights: Llama 8 layers, hidden 256, 8 heads / 2 KV heads; system prompt 64 tokens, "
           f"{n_docs} documents of 96-160 tokens, question 16; {prompts_per_k} prompts per k = 2..6; "
           f"{new} greedy tokens")
    rows: dict[str, list[tuple[float, ...]]] = {name: [] for name, _ in _methods()}
    by_k: dict[tuple[str, int], list[float]] = {}
    for k in range(2, 7):
        for _ in range(prompts_per_k):
            chosen = rng.sample(docs, k)
            prompt, spans = list(system), []
            for doc in chosen:
                spans.append((len(prompt), len(prompt) + len(doc)))
                prompt += doc
            prompt += [rng.randrange(3, 1024) for _ in range(16)]
            full = None
            for name, ratio in _methods():
                if name == "full":
                    cache = _engine_cache(model, [], tiers=False)
                elif name == "prefix":
                    cache = _engine_cache(model, system, tiers=False)
                else:
                    cache = shared
                req, ttft = _serve(model, cache, prompt, spans, new, ratio, segments if ratio is not None else None)
                _check_hit(name, req, system, 16)
                if cache is not shared:
                    cache.close()
                full = req if name == "full" else full
                assert full is not None
                rows[name].append((ttft, *_compare(req, full)))
                by_k.setdefault((name, k), []).append(ttft)
    full_ttft = statistics.median(r[0] for r in rows["full"])
    report("| method | TTFT median ms | vs full | max abs dlogit (median) | KL median | first token = full "
           "| continuation = full |")
    report("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, _ in _methods():
        r = rows[name]
        ttft = statistics.median(x[0] for x in r)
        report(f"| {name} | {ttft * 1e3:.1f} | {full_ttft / ttft:.2f}x | {statistics.median(x[1] for x in r):.4f} "
               f"| {statistics.median(x[2] for x in r):.2e} | {sum(x[3] for x in r) / len(r):.0%} "
               f"| {sum(x[4] for x in r) / len(r):.0%} |")
    report()
    report("TTFT median ms by k (documents in the prompt):")
    report("| method | " + " | ".join(f"k={k}" for k in range(2, 7)) + " |")
    report("| --- |" + " ---: |" * 5)
    for name, _ in _methods():
        report(f"| {name} | " + " | ".join(f"{statistics.median(by_k[(name, k)]) * 1e3:.1f}" for k in range(2, 7))
               + " |")
    shared.close()


def trained(report: Report, steps: int, questions: int, seed: int, layers: int = 4) -> None:
    """Part 2: answer accuracy of the model trained on ``radixkv.bench.blend_task``, on
    conflicting questions (two documents state the key: the first one's value is the answer)
    and single ones, half each."""
    from radixkv.bench import blend_task as task
    from radixkv.integrations.paged_blend import segment_kv
    from radixkv.reuse.segments import SegmentCache

    t0 = time.perf_counter()
    model = task.train(steps, seed=seed, log=report, layers=layers)
    config = task.model_config(layers)
    report(f"## trained model ({steps} steps, {time.perf_counter() - t0:.0f} s): Llama {config.num_hidden_layers} "
           f"layers, hidden {config.hidden_size}, 4 heads / 2 KV heads; a corpus of 24 documents of {task.FACTS} "
           f"facts over {task.NUM_KEYS} keys; {questions} questions (half conflicting), k = 2..6 documents in "
           f"random order")
    corpus = task.Corpus(24, seed + 1)
    shared = _engine_cache(model, task.SYSTEM, tiers=True)
    segments = SegmentCache(shared.stack)
    for doc in corpus.docs:
        tokens = task.doc_tokens(doc)
        segments.store(tokens, segment_kv(model, tokens, torch.float32))
    shared.flush()
    rng = random.Random(seed + 2)
    names = [name for name, _ in _methods()]
    right = {(name, c): 0 for name in names for c in (True, False)}
    agree = dict.fromkeys(names, 0)
    kls: dict[str, list[float]] = {name: [] for name in names}
    for i in range(questions):
        prompt = corpus.question(rng, rng.randint(2, 6), conflicting=i % 2 == 0)
        full_answer, full_req = None, None
        for name, ratio in _methods():
            cache = _engine_cache(model, task.SYSTEM if name != "full" else [], tiers=False) \
                if ratio is None else shared
            req, _ = _serve(model, cache, prompt.tokens, prompt.spans, 1, ratio,
                            segments if ratio is not None else None)
            _check_hit(name, req, task.SYSTEM, 16)
            if cache is not shared:
                cache.close()
            answer = req.output[0]
            if name == "full":
                full_answer, full_req = answer, req
            kls[name].append(_compare(req, full_req)[1])
            right[(name, prompt.conflicting)] += answer == prompt.answer
            agree[name] += answer == full_answer
    half = {True: (questions + 1) // 2, False: questions // 2}
    report("| method | conflicting questions right | single questions right | answer = full prefill's "
           "| KL(full ‖ method) median | KL p90 |")
    report("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in names:
        kl = sorted(kls[name])
        report(f"| {name} | {right[(name, True)] / half[True]:.1%} | {right[(name, False)] / half[False]:.1%} "
               f"| {agree[name] / questions:.1%} | {statistics.median(kl):.2e} | {kl[int(0.9 * (len(kl) - 1))]:.2e} |")
    shared.close()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring); 0 on success."""
    parser = Parser(prog="python -m radixkv.bench blend", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts-per-k", type=int, default=4)
    parser.add_argument("--docs", type=int, default=16, help="documents in the corpus (n)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--train-steps", type=int, default=2000)
    parser.add_argument("--questions", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=4, help="of the trained model")
    parser.add_argument("--skip-random", action="store_true", help="only part 2")
    parser.add_argument("--skip-trained", action="store_true", help="only part 1")
    parser.add_argument("--out", type=out_file, default=None)
    args = parser.parse_args(argv)
    report = Report("blend", argv)
    if not args.skip_random:
        random_weights(report, args.prompts_per_k, args.docs, args.new_tokens, args.seed)
        report()
    if not args.skip_trained:
        trained(report, args.train_steps, args.questions, args.seed, args.layers)
    report.save(args.out)
    return 0
