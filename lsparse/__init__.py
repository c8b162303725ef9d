"""lsparse: run language models larger than RAM by paging sparse FFN neurons from flash."""

__version__ = "0.1.0"
