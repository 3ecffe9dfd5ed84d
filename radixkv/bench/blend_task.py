"""A synthetic RAG task whose answer needs two documents at once, and a small Llama trained on it
here, on the CPU, in a few minutes: the trained model of ``python -m radixkv.bench blend``.

**The task: ranked documents that disagree.**  A fact is one token ``F(key, value)`` ("``key``
is ``value``"); a document is ``DOC`` and ``FACTS`` facts of distinct keys.  Documents disagree:
a key may be stated by several documents, with another value in each, and the answer is the value
stated by the *first* document, in prompt order, that states the key (retrieval ranks its
documents: the higher ranked one is authoritative).  A prompt is the system prompt, ``k``
documents and ``Q K(key)``; the answer is one token ``V(value)``.  A *conflicting* question asks
a key that two or more of the prompt's documents state with different values: its answer depends
on which document comes first, so on two documents at once; a *single* question asks a key stated
once (or always with the same value), which one document answers.

Why it is a test of blending: whether a fact is overridden depends on what an earlier document
says, and a document's KV computed on its own (a segment) has never seen the earlier documents.
Naive reuse can only answer a conflicting question right where the question itself can still
tell which statement came first; CacheBlend recomputes the tokens whose KV changes most with the
context.  (Facts are single tokens so that a lookup is one attention step, which a small model
learns in a few hundred steps on a CPU; an earlier version with ``key value`` token pairs needs
induction heads, and a 2-3 layer model did not form them in minutes: 13-16% per answer token
after 1,500 steps.)

Training draws fresh random documents every batch (the model learns to look facts up, not a
table), with ``QUESTIONS`` questions per prompt, half of them conflicting when the prompt has a
conflict.  Evaluation uses a fixed corpus of documents whose KV a segment cache holds, ``k`` of
them per prompt in random order.  Training is deterministic for a seed.

``python -m radixkv.bench.blend_task`` trains the model and prints its full-prefill accuracy.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any, NamedTuple

import torch

from radixkv.tools._args import Parser, Refused

PAD, BOS, DOC, Q = 0, 1, 2, 3
SYSTEM = [BOS, 4, 5, 6, 7]                  # the system prompt
FACTS = 4                                   # facts per document
QUESTIONS = 8                               # questions per training prompt (evaluation asks one)
NUM_KEYS, NUM_VALUES = 32, 16
FACT0 = 8                                   # F(key, value) = FACT0 + key * NUM_VALUES + value
KEY0 = FACT0 + NUM_KEYS * NUM_VALUES        # K(key): a key asked
VALUE0 = KEY0 + NUM_KEYS                    # V(value): an answer
VOCAB = VALUE0 + NUM_VALUES

Document = list[tuple[int, int]]            # (key, value) facts


def doc_tokens(doc: Document) -> list[int]:
    """A document's tokens: ``DOC`` and one token per fact."""
    return [DOC, *(FACT0 + key * NUM_VALUES + value for key, value in doc)]


def random_documents(rng: random.Random, count: int) -> list[Document]:
    """``count`` documents of ``FACTS`` distinct keys each, drawn from ``FACTS * count`` keys (at
    most ``NUM_KEYS``), so that keys recur across documents with their own values."""
    keys = rng.sample(range(NUM_KEYS), min(NUM_KEYS, FACTS * count))
    return [[(key, rng.randrange(NUM_VALUES)) for key in rng.sample(keys, FACTS)] for _ in range(count)]


class Prompt(NamedTuple):
    """An evaluation prompt: ``tokens`` (ending ``Q K(key)``), the documents' ``spans``, the
    ``answer`` token and whether the question is ``conflicting``."""

    tokens: list[int]
    spans: list[tuple[int, int]]
    answer: int
    conflicting: bool


def statements(docs: list[Document]) -> tuple[dict[int, int], set[int]]:
    """The answer of every key the documents state (the first document's value) and the keys
    whose statements disagree."""
    first: dict[int, int] = {}
    conflicts = set()
    for doc in docs:
        for key, value in doc:
            if first.setdefault(key, value) != value:
                conflicts.add(key)
    return first, conflicts


def prompt_of(docs: list[Document], key: int) -> Prompt:
    """The prompt over ``docs`` (in this order) asking ``key``."""
    tokens, spans = list(SYSTEM), []
    for doc in docs:
        spans.append((len(tokens), len(tokens) + FACTS + 1))
        tokens += doc_tokens(doc)
    first, conflicts = statements(docs)
    return Prompt(tokens + [Q, KEY0 + key], spans, VALUE0 + first[key], key in conflicts)


class Corpus:
    """``count`` fixed documents: the knowledge base whose KV a segment cache holds."""

    def __init__(self, count: int, seed: int) -> None:
        rng = random.Random(seed)
        keys = list(range(NUM_KEYS))
        self.docs = [[(key, rng.randrange(NUM_VALUES)) for key in rng.sample(keys, FACTS)] for _ in range(count)]

    def question(self, rng: random.Random, k: int, conflicting: bool) -> Prompt:
        """A prompt of ``k`` corpus documents in random order asking a conflicting key (when
        ``conflicting``) or a single one; documents are drawn again until there is one."""
        while True:
            docs = rng.sample(self.docs, k)
            first, conflicts = statements(docs)
            pool = sorted(conflicts) if conflicting else sorted(set(first) - conflicts)
            if pool:
                return prompt_of(docs, rng.choice(pool))


def model_config(layers: int = 4, hidden: int = 64) -> Any:
    """The Llama config of the task's model (GQA: 4 heads, 2 KV heads)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    config.name_or_path = f"radixkv/blend-task-l{layers}-h{hidden}"
    return config


def _training_prompt(rng: random.Random) -> tuple[list[int], list[int]]:
    """A training prompt with ``QUESTIONS`` questions (``Q K(key) V(value) K(key) ...``) and the
    positions of their answers."""
    docs = random_documents(rng, rng.randint(2, 6))
    first, conflicts = statements(docs)
    tokens = list(SYSTEM)
    for doc in docs:
        tokens += doc_tokens(doc)
    tokens.append(Q)
    targets = []
    for i in range(QUESTIONS):
        key = rng.choice(sorted(conflicts) if conflicts and i % 2 == 0 else list(first))
        tokens.append(KEY0 + key)
        targets.append(len(tokens))
        tokens.append(VALUE0 + first[key])
    return tokens, targets


def train(steps: int = 2000, batch: int = 32, seed: int = 0, log: Any = print, layers: int = 4) -> Any:
    """Train the task's model from ``seed``; return it in eval mode.  Cost: ``steps`` forward and
    backward passes of ``batch`` prompts of 2-6 documents (2-3 minutes on 2 CPU cores)."""
    import transformers

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = transformers.AutoModelForCausalLM.from_config(model_config(layers))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    t0 = time.perf_counter()
    for step in range(steps):
        examples = [_training_prompt(rng) for _ in range(batch)]
        width = max(len(t) for t, _ in examples)
        ids = torch.full((batch, width), PAD)
        rows, cols = [], []
        for i, (tokens, where) in enumerate(examples):     # right padding: causal, so harmless
            ids[i, :len(tokens)] = torch.tensor(tokens)
            rows += [i] * len(where)
            cols += where
        col = torch.tensor(cols)
        logits = model(input_ids=ids).logits[rows, col - 1]          # the token before predicts the answer
        target = ids[rows, col]
        loss = torch.nn.functional.cross_entropy(logits, target)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 250 == 0 or step == steps - 1:
            acc = float((logits.argmax(-1) == target).float().mean())
            log(f"# step {step:5d}  loss {loss.item():.3f}  answer accuracy {acc:.2f}  {time.perf_counter() - t0:.0f} s")
    return model.train(False)


def trained(steps: int = 2000, seed: int = 0, log: Any = print, cache_dir: str | None = None) -> Any:
    """The model ``train(steps, seed=seed)`` makes, trained once per machine: its weights are kept
    in ``cache_dir`` (default ``$RADIXKV_MODEL_CACHE``, else ``~/.cache/radixkv``) and loaded from
    there next time (safetensors: raw tensors, nothing deserialized as code).  Cost: a training run the
    first time, a file read after."""
    import os

    import transformers

    folder = cache_dir or os.environ.get("RADIXKV_MODEL_CACHE") or os.path.expanduser("~/.cache/radixkv")
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, f"blend-task-l4-h64-seed{seed}-steps{steps}.safetensors")
    if os.path.exists(path):
        model = transformers.AutoModelForCausalLM.from_config(model_config())
        model.load_state_dict(load_file(path))
        log(f"# trained model loaded from {path}")
        return model.train(False)
    model = train(steps, seed=seed, log=log)
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path + ".tmp")
    os.replace(path + ".tmp", path)
    return model


def main(argv: list[str] | None = None) -> int:
    """Train the model and print its full-prefill accuracy on a corpus; 0."""
    parser = Parser(prog="python -m radixkv.bench.blend_task", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = train(args.steps, seed=args.seed)
    corpus, rng = Corpus(24, args.seed + 1), random.Random(args.seed + 2)
    for conflicting in (True, False):
        right = 0
        for _ in range(200):
            p = corpus.question(rng, rng.randint(2, 6), conflicting)
            with torch.no_grad():
                right += int(model(input_ids=torch.tensor(p.tokens)[None]).logits[0, -1].argmax()) == p.answer
        print(f"full-prefill accuracy, {'conflicting' if conflicting else 'single'} questions: {right / 200:.3f}")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except Refused as exc:          # a bad flag: one line, as every benchmark command
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None
