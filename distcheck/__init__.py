"""distcheck — a deadlock and desync doctor for PyTorch distributed jobs."""

from distcheck.scenario import ScenarioContext, scenario

__version__ = "0.1.0"
__all__ = ["ScenarioContext", "scenario", "__version__"]
