"""A pipeline's text set (``data.calibration``, ``data.evaluation``): the spec the pipeline file declares
and ``opus.runtime.data`` reads, here so that the runtime and the run engine both import it downwards."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TextSetSpec(BaseModel):
    """Text declared once for any model: files/globs or a dataset (opus.runtime.data reads both)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # as the pipeline file's other mappings

    files: list[str] | None = None
    # A save_to_disk directory, a directory of data files (or one file), or a hub dataset id in the local cache.
    dataset: str | None = None
    split: str | None = None  # the split of a DatasetDict (needed when it holds more than one)
    text_column: str = "text"
    samples: int = Field(32, gt=0)
    seq_len: int = Field(256, gt=1)
    seed: int = 0

    @model_validator(mode="after")
    def _one_kind(self) -> TextSetSpec:
        if (self.files is None) == (self.dataset is None):
            raise ValueError("give exactly one of files or dataset")
        if self.split is not None and self.dataset is None:
            raise ValueError("split names a split of a dataset; it needs dataset, not files")
        return self
