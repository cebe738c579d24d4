"""Graph partitioning (see stage.py's doc). partition.py moved here whole, as stage.py, so that
its history follows; the next commit splits it by job."""

from .stage import *  # noqa: F401,F403
from .stage import __all__  # noqa: F401
