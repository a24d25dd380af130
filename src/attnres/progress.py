"""Progress bars: ``tqdm`` when it is installed (the ``train`` extra), nothing otherwise.

Long work shows a bar on stderr (a training run's steps, a grid's runs, tokenising a
corpus); a bar is a convenience, so without ``tqdm`` the work runs silently.
"""

from __future__ import annotations


def progress_bar(enabled: bool = True, **kwargs):
    """``tqdm(dynamic_ncols=True, **kwargs)``, or ``None`` when not ``enabled`` or without tqdm."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(dynamic_ncols=True, **kwargs)
