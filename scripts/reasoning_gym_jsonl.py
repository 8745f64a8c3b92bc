"""Write a reasoning-gym dataset as a jsonl file the ``jsonl`` data source reads, for the
``reasoning_gym`` environment (``gfcr.stages.environments.procedural``).

Each row is one entry: ``prompt`` (the question), ``answer``, ``source_index`` (the entry's
index, which the environment reads from the prompt's metadata with ``metadata_fields:
[source_index]``) and the entry's scalar metadata fields (``expression`` for ``chain_sum``), so a
pipeline's ``template`` can show the task in another form. The environment is given the same
dataset and config, and rebuilds the entries itself to score answers.

    python scripts/reasoning_gym_jsonl.py chain_sum '{"seed": 0, "size": 200, "min_terms": 2,
        "max_terms": 2, "min_digits": 1, "max_digits": 2}' pipelines/examples/data/chain_sum.jsonl
"""

from __future__ import annotations

import json
import sys


def main(name: str, config_json: str, out: str) -> None:
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(name, **json.loads(config_json))
    with open(out, "w", encoding="utf-8") as handle:
        for i in range(len(dataset)):
            entry = dataset[i]
            scalars = {k: v for k, v in entry["metadata"].items() if isinstance(v, (str, int, float, bool))}
            row = {**scalars, "prompt": entry["question"], "answer": entry["answer"], "source_index": i}
            handle.write(json.dumps(row, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
