"""Train the builtin models' weights so a completion reads as words: `python -m relayout.bench.train_builtin`.

The builtin models are byte-level (engine/model/builtin.py: 256 bytes, BOS, EOS). Random weights answer
"hello" with control bytes, which looks broken to a person trying the product. This script trains
`builtin:tiny` and `builtin:tiny-mixtral` (their shapes unchanged: the tests' KV sizes and the benches
stay comparable) on short stories it generates itself from a fixed word list (deterministic seed; no
download), with transformers' own implementation of each architecture, starting from the builtin
random initialisation; it writes `engine/model/builtin_weights/NAME.safetensors` (float32, under 1 MB
each), which engine/model/builtin.py loads in place of the random weights. A few minutes on 2 CPU cores.

`builtin:bench` stays random: at its shapes (8 layers, hidden 512, 16 experts) the weights are ~160 MB,
not package data, and it exists to measure KV movement, not to be read. The untrained tiny model stays
available as `builtin:tiny-random` (checkpoints written before the weights were trained restore into it).

transformers is a test dependency: this script is for maintainers, not imported by the product."""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

NAMES = ("tiny", "tiny-mixtral")
OUT = Path(__file__).resolve().parent.parent / "engine" / "model" / "builtin_weights"
SEED = 20261207

_NAMES = ["Tom", "Lily", "Max", "Anna", "Ben", "Sue", "Mia", "Sam"]
_ANIMALS = ["cat", "dog", "fox", "bird", "bear", "frog", "duck", "mouse"]
_ADJ = ["little", "big", "red", "happy", "old", "small", "kind", "brave"]
_PLACES = ["park", "forest", "garden", "river", "house", "hill", "town", "field"]
_THINGS = ["ball", "kite", "box", "hat", "apple", "book", "cake", "toy"]
_FEEL = ["happy", "sad", "glad", "tired", "proud", "scared", "calm", "surprised"]
_DO = ["play", "run", "sing", "read", "jump", "swim", "draw", "walk"]


def story(r: random.Random) -> str:
    """One short story of simple sentences: the text the builtin models learn to continue."""
    name, friend = r.sample(_NAMES, 2)
    animal, adj, place, thing = r.choice(_ANIMALS), r.choice(_ADJ), r.choice(_PLACES), r.choice(_THINGS)
    lines = [f"Once upon a time, there was a {adj} {animal} named {name}.",
             f"{name} liked to {r.choice(_DO)} in the {place}.",
             f"One day, {name} found a {r.choice(_ADJ)} {thing}.",
             f"{name} was very {r.choice(_FEEL)}.",
             f"Then {name} met a friend named {friend}.",
             f"\"Do you want to {r.choice(_DO)} with me?\" said {name}.",
             f"\"Yes!\" said {friend}, and they went to the {r.choice(_PLACES)} together.",
             f"They played with the {thing} all day.",
             f"When the sun went down, {name} and {friend} were {r.choice(_FEEL)}.",
             "The end."]
    keep = [lines[0]] + [ln for ln in lines[1:-1] if r.random() < 0.8] + [lines[-1]]
    return " ".join(keep)


def corpus(n_stories: int, seed: int = SEED) -> bytes:
    r = random.Random(seed)
    return ("\n".join(story(r) for _ in range(n_stories)) + "\n").encode()


def train(name: str, steps: int, seq: int = 1024, batch: int = 6, lr: float = 3e-3, log=print) -> dict:
    from relayout.engine.model.builtin import create_builtin
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    data = torch.tensor(list(corpus(4000)), dtype=torch.long)
    with tempfile.TemporaryDirectory() as tmp:
        src = create_builtin(name, Path(tmp) / "init", random_weights=True)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
        g = torch.Generator().manual_seed(SEED)
        t0 = time.perf_counter()
        for step in range(steps):
            starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
            x = torch.stack([data[s: s + seq] for s in starts])
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % 100 == 0 or step == steps - 1:
                log(f"{name}: step {step} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)")
        model.eval()
        out = Path(tmp) / "trained"
        model.save_pretrained(out)
        tensors = {}
        for f in sorted(out.glob("*.safetensors")):
            tensors.update(load_file(f))
    return {k: v.contiguous().float() for k, v in tensors.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--names", default=",".join(NAMES))
    a = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for name in a.names.split(","):
        tensors = train(name, a.steps)
        save_file(tensors, str(OUT / f"{name}.safetensors"), metadata={"format": "pt", "trained_steps": str(a.steps),
                                                                         "seed": str(SEED)})
        print(f"wrote {OUT / f'{name}.safetensors'}")


if __name__ == "__main__":
    main()
