import os
import sys
import warnings

# tests/helpers is importable as `helpers`, in the test process and in the ranks it spawns.
sys.path.insert(0, os.path.dirname(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])
os.environ.setdefault("WANDB_MODE", "offline")
warnings.filterwarnings("ignore", category=FutureWarning)
