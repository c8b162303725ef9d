"""lsparse: run language models larger than RAM by paging sparse FFN neurons from flash.

From Python, as with mlx-lm (docs/API.md):

    from lsparse import load, generate
    model, tokenizer = load("out/image", mode="predicted", ram_budget="50%")
    print(generate(model, tokenizer, "Once upon a time", max_tokens=64))
"""

__version__ = "0.1.0"

_API = ("BenchOptions", "Chat", "CompileOptions", "DecodeOptions", "GenerationResponse", "bench", "compile",
        "generate", "load", "make_sampler", "stream_generate")


def __getattr__(name: str):
    """The API loads on first use: `import lsparse` (as the command line does) stays light."""
    if name in _API:
        from lsparse import api
        return getattr(api, name)
    raise AttributeError(f"module 'lsparse' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_API])
