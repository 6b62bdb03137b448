"""distcheck — a deadlock and desync doctor for PyTorch distributed jobs."""

from distcheck.models import VERSION as __version__
from distcheck.scenario import ScenarioContext, scenario

__all__ = ["ScenarioContext", "__version__", "scenario"]
