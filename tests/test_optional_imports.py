"""``import dpfy`` and its training and federated layers need none of the optional extras'
libraries, and the Flower strategy names its extra when Flower is missing.

One fresh interpreter checks every such import at once (this one has imported them all, and
starting one costs seconds of torch's import).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The libraries of the optional extras in pyproject.toml beyond ``train`` (nlp, sft, features,
#: fed, images, lightning, bench).
OPTIONAL = ("transformers", "tokenizers", "safetensors", "peft", "accelerate", "trl", "flwr",
            "kymatio", "lightning", "opacus")


def test_dpfy_imports_no_optional_library_and_flower_names_its_extra() -> None:
    code = (
        "import sys\n"
        "sys.modules['flwr'] = None  # Flower not installed: importing it fails\n"
        "import dpfy, dpfy.training, dpfy.fed\n"
        f"print(sorted(m for m in {OPTIONAL!r} if sys.modules.get(m) is not None))\n"
        "try:\n    import dpfy.fed.flower\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    imported, message = out.stdout.split("\n", 1)
    assert imported == "[]", imported
    assert "dpfy[fed]" in message
