"""Greedy ``generate`` of optimum's ``ORTModelForCausalLM`` on a folder, run by the interpreter
that has optimum (``tests/test_export_genai.py``; optimum-onnx pins transformers < 4.58, so
it lives in an environment of its own, see docs/export.md).

    python tests/optimum_generate.py DIR '[[5, 9, 2]]' 16   # prints the token ids as JSON
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM

    path, prompts, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    model = ORTModelForCausalLM.from_pretrained(path)
    out = []
    for ids in prompts:
        tokens = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=new,
            do_sample=False,
        )
        out.append(tokens[0].tolist())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
