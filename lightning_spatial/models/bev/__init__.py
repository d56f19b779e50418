"""Multi-camera BEV detectors over the shared surround batch (plain LightningModules: nothing here knows about
sharding, so they train unchanged on one device and under ``spatial_tp``)."""

from .bevformer import BEVFormer
from .lift_splat import LiftSplat
from .petr import PETR
from .simple_bev import SimpleBEV

__all__ = ["BEVFormer", "PETR", "LiftSplat", "SimpleBEV"]
