"""Logged values, torchmetrics and ``self.all_gather`` reduce over data replicas only: every rank of a spatial
group saw the same samples, so nothing may be counted once per spatial rank.

4 ranks = 2 data replicas x 2 spatial ranks, values that differ per replica, sums and counts (a mean would
hide a double count), and metrics created at every point a user creates them.
"""

from __future__ import annotations

import torch
import torchmetrics
from torchmetrics.aggregation import CatMetric, SumMetric

from tests.strategy.lit import Images, LitModel, loader
from tests.strategy.test_strategy import trainer


class Indexed(Images):
    def __getitem__(self, i):
        return {**super().__getitem__(i), "index": torch.tensor(i)}


class Counting(LitModel):
    """Counts samples every way a user might; checks ``self.all_gather`` and the concatenated indices in the rank."""

    def __init__(self, samples: int):
        super().__init__("segnet")
        self.samples = samples
        self.count = SumMetric()  # an attribute: a registered submodule since __init__
        self.indices = CatMetric()
        self.in_a_dict = {"count": SumMetric()}  # a plain dict: not a submodule, invisible to a module walk

    def on_validation_epoch_start(self):
        self.late = torchmetrics.SumMetric()  # created after the strategy's setup

    def validation_step(self, batch, batch_idx):
        labels, index = batch["label"], batch["index"]
        self.log("label_sum", labels.sum().float(), reduce_fx="sum", sync_dist=True)
        n = torch.tensor(float(len(labels)))
        for metric in (self.count, self.in_a_dict["count"], self.late):
            metric.update(n)
        self.indices.update(index)
        gathered = self.all_gather(index)  # one row per data replica, as DDP over 2 ranks would return
        assert gathered.shape == (2, len(index)), gathered.shape
        replica = self.trainer.global_rank // 2
        assert torch.equal(gathered[replica], index) and not set(gathered[1 - replica].tolist()) & set(index.tolist())

    def on_validation_epoch_end(self):
        self.log("count", self.count.compute())
        self.log("count_in_a_dict", self.in_a_dict["count"].compute())
        self.log("count_created_late", self.late.compute())
        indices = self.indices.compute()
        assert sorted(indices.tolist()) == list(range(self.samples)), indices


def test_sums_counts_and_gathers_span_data_replicas_once():
    data = Indexed(8, 16, 24)
    logged = trainer(4, 2).validate(Counting(8), loader(data, 2), verbose=False)[0]
    assert logged["label_sum"] == data.labels.sum().item()
    for key in ("count", "count_in_a_dict", "count_created_late"):
        assert logged[key] == 8, (key, logged[key])


def test_the_run_claims_its_module_metrics_only_and_gives_them_back():
    """What the strategy does to torchmetrics: the module's metrics (submodules, plain dicts and lists) sync over the
    data axis for the run through their own ``process_group``; a metric that names a group keeps it, a metric
    outside the module is not touched, and ``release`` restores every one."""
    from lightning_spatial.strategies._scopes import MetricsOverData

    group, own = object(), object()  # stand-ins for process groups: only their identity matters here
    module = torch.nn.Module()
    module.count = SumMetric()
    module.lists = [CatMetric(), {"nested": SumMetric()}]
    module.named = SumMetric(process_group=own)
    elsewhere = SumMetric()
    claim = MetricsOverData(group)
    claim.claim(module)
    assert module.count.process_group is group and module.lists[0].process_group is group
    assert module.lists[1]["nested"].process_group is group
    assert module.named.process_group is own and elsewhere.process_group is None
    claim.release()
    assert all(m.process_group is None for m in (module.count, module.lists[0], module.lists[1]["nested"]))
    assert module.named.process_group is own
