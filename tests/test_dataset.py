"""vlmprobe.dataset: a dataset's shapes read from the formats people fine-tune with, image tokens per family for
any (height, width), and the micro batches each rank runs, compared with the real implementations (transformers'
processors and LengthGroupedSampler, accelerate's prepared data loader) and with hand counts."""

from __future__ import annotations

import csv
import json
import math
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from vlmprobe.dataset import (COLUMNS, Sample, image_tokens, plan_batches, read_samples, sample_notes,
                              summarize_plan, video_tokens, worst, write_steps_csv)
from vlmprobe.dataset.batches import sample_order
from vlmprobe.errors import ConfigError
from vlmprobe.models.base import DataShape
from vlmprobe.models.idefics3 import idefics3_tiles
from vlmprobe.models.mistral3 import pixtral_grid

SHAPES = [{"text_tokens": 120, "images": [[448, 640]]}, {"text_tokens": 7, "images": [], "videos": [[8, 224, 224]]},
          {"text_tokens": 0, "images": [[10, 20], [30, 40]]}]
EXPECTED = [Sample(0, 120, ((448, 640),), (), "given (text_tokens)"), Sample(1, 7, (), ((8, 224, 224),), "given (text_tokens)"),
            Sample(2, 0, ((10, 20), (30, 40)), (), "given (text_tokens)")]


def text_only(lengths):
    return [Sample(i, n) for i, n in enumerate(lengths)]


# -- sources ------------------------------------------------------------------------------------------------
def test_a_shapes_file_reads_the_same_from_jsonl_csv_and_parquet(tmp_path):
    (tmp_path / "s.jsonl").write_text("\n".join(json.dumps(r) for r in SHAPES))
    with (tmp_path / "s.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["text_tokens", "images", "videos"])
        writer.writeheader()
        writer.writerows({"text_tokens": r["text_tokens"], "images": json.dumps(r["images"]),
                          "videos": json.dumps(r.get("videos", []))} for r in SHAPES)
    pq.write_table(pa.Table.from_pylist([{**r, "videos": r.get("videos", [])} for r in SHAPES]), tmp_path / "s.parquet")
    for name in ("s.jsonl", "s.csv", "s.parquet"):
        assert read_samples(tmp_path / name) == EXPECTED, name


def images_in(folder, sizes):
    """Tiny PNG and JPEG files of these (height, width), named img0.png, img1.jpg, ..."""
    names = []
    for i, (h, w) in enumerate(sizes):
        name = f"img{i}.{'png' if i % 2 == 0 else 'jpg'}"
        Image.new("RGB", (w, h), (i, 0, 0)).save(folder / name)
        names.append(name)
    return names


def test_sharegpt_images_are_sized_from_their_headers_without_decoding(tmp_path, monkeypatch):
    (tmp_path / "media").mkdir()
    names = images_in(tmp_path / "media", [(31, 57), (64, 17)])
    record = {"conversations": [{"from": "human", "value": "<image><image>abcdefgh"}, {"from": "gpt", "value": "ijkl"}],
              "system": "mn", "images": [f"media/{n}" for n in names]}
    (tmp_path / "sg.json").write_text(json.dumps([record]))
    monkeypatch.setattr(Image.Image, "load", lambda self: pytest.fail("an image was decoded"))
    [sample] = read_samples(tmp_path / "sg.json")
    assert sample.images == ((31, 57), (64, 17))
    assert sample.text_tokens == math.ceil(len("mnabcdefghijkl") / 4)  # placeholders removed, characters / 4
    assert sample_notes([sample]) == ["text tokens of 1 sample(s): estimate: characters / 4"]


def test_a_llamafactory_registry_entry_follows_its_columns_and_tags(tmp_path):
    names = images_in(tmp_path, [(20, 30)])
    rows = [{"msgs": [{"role": "user", "content": "<image>12345678"}, {"role": "assistant", "content": "1234"}],
             "pics": names}]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    entry = {"file_name": "data.jsonl", "formatting": "sharegpt", "columns": {"messages": "msgs", "images": "pics"},
             "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mine": entry}))
    [sample] = read_samples(tmp_path / "dataset_info.json", dataset="mine")
    assert (sample.text_tokens, sample.images) == (3, ((20, 30),))
    with pytest.raises(ConfigError, match="dataset='other' is not allowed.*mine"):
        read_samples(tmp_path, dataset="other")


def test_alpaca_ms_swift_and_trl_records_count_their_texts(tmp_path):
    names = images_in(tmp_path, [(8, 9), (10, 11)])
    alpaca = {"instruction": "abcd", "input": "ef", "output": "gh", "history": [["ij", "kl"]], "images": [names[0]]}
    swift = {"messages": [{"role": "user", "content": "<image>abcdefgh"}, {"role": "assistant", "content": "ij"}],
             "images": [names[1]]}
    trl = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "abcdefghi"}]},
                        {"role": "assistant", "content": [{"type": "text", "text": "j"}]}], "images": names}
    for record, tokens, images in ((alpaca, 3, ((8, 9),)), (swift, 3, ((10, 11),)), (trl, 3, ((8, 9), (10, 11)))):
        (tmp_path / "d.jsonl").write_text(json.dumps(record))
        [sample] = read_samples(tmp_path / "d.jsonl", image_dir=tmp_path)
        assert (sample.text_tokens, sample.images) == (tokens, images)


def test_a_save_to_disk_folder_is_read_with_pyarrow(tmp_path):
    """The layout datasets' save_to_disk writes: state.json listing Arrow stream files; an Image column as
    {bytes, path} structs."""
    import io

    buffer = io.BytesIO()
    Image.new("RGB", (13, 7)).save(buffer, format="PNG")
    table = pa.Table.from_pylist([{"messages": [{"role": "user", "content": "abcdefgh"}],
                                   "images": [{"bytes": buffer.getvalue(), "path": None}]}])
    with pa.OSFile(str(tmp_path / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (tmp_path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    [sample] = read_samples(tmp_path)
    assert (sample.text_tokens, sample.images) == (2, ((7, 13),))


def test_a_tokenizer_from_a_file_or_the_local_cache_counts_the_text(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "c": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    snapshot = tmp_path / "cache" / "models--org--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    tok.save(str(snapshot / "tokenizer.json"))
    (tmp_path / "cache" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "cache" / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    record = {"messages": [{"role": "user", "content": "a b c zzz"}, {"role": "assistant", "content": "a a"}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(record))
    for tokenizer in (snapshot, "org/tiny"):
        [sample] = read_samples(tmp_path / "d.jsonl", tokenizer=tokenizer, cache_dir=tmp_path / "cache")
        assert sample.text_tokens == 6  # words, by hand
    [sample] = read_samples(tmp_path / "d.jsonl", tokenizer="org/absent", cache_dir=tmp_path / "cache")
    assert sample.text_tokens == math.ceil(len("a b c zzza a") / 4) and "not in the local" in sample.text_from


def test_a_synthetic_dataset_is_seeded_and_drawn_as_stated():
    config = {"samples": 50, "seed": 3, "text_tokens": {"lognormal": {"mean": 5.0, "sigma": 0.5}},
              "images_per_sample": {"choice": [0, 2]}, "image_height": {"uniform": [100, 200]}, "image_width": 300}
    samples = read_samples(config)
    assert samples == read_samples("synthetic:" + json.dumps(config)) and len(samples) == 50
    rng = np.random.default_rng(3)  # the stated order: tokens, count, then each image's sides
    first = int(round(float(rng.lognormal(5.0, 0.5))))
    assert samples[0].text_tokens == first
    assert {len(s.images) for s in samples} == {0, 2}
    assert all(100 <= h <= 200 and w == 300 for s in samples for h, w in s.images)
    with pytest.raises(ConfigError, match=r"synthetic.text_tokens=\{'normal'.*is not allowed"):
        read_samples({**config, "text_tokens": {"normal": 3}})


def test_bad_input_is_one_line_naming_it(tmp_path, spec):
    (tmp_path / "m.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "x"}], "images": ["gone.png"]}))
    (tmp_path / "bad.png").write_bytes(b"not a png")
    (tmp_path / "u.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "x"}], "images": ["bad.png"]}))
    (tmp_path / "n.jsonl").write_text(json.dumps({"messages": [], "images": []}))
    (tmp_path / "e.jsonl").write_text("")
    (tmp_path / "t.txt").write_text("hello")
    (tmp_path / "k.jsonl").write_text(json.dumps({"text": "hello"}))
    cases = [("m.jsonl", "image 'gone.png' of sample 0 is not allowed: no such file"),
             ("u.jsonl", "image 'bad.png' of sample 0 is not allowed: it cannot be read as an image"),
             ("n.jsonl", "sample 0 is not allowed: it has no length information"),
             ("e.jsonl", "it holds no samples"), ("t.txt", ".txt is not a format it reads; readable: a shapes"),
             ("k.jsonl", "match no format; formats: shapes")]
    for name, message in cases:
        with pytest.raises(ConfigError, match=message) as error:
            read_samples(tmp_path / name)
        assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="plan.steps=0 is not allowed"):
        plan_batches(text_only([1, 2]), None, batch_size=1, steps=0)
    with pytest.raises(ConfigError, match="plan.sampler='shuffle' is not allowed: use one of random"):
        plan_batches(text_only([1, 2]), None, batch_size=1, steps=1, sampler="shuffle")
    with pytest.raises(ConfigError, match="no per-image token rule for SimpleNamespace"):
        image_tokens(SimpleNamespace(), 10, 10)
    with pytest.raises(ConfigError, match="videos are not allowed for llava_tiny"):
        video_tokens(spec("llava_tiny"), 4, 10, 10)


# -- image tokens -------------------------------------------------------------------------------------------
SIDES = [(13, 13), (28, 1000), (448, 640), (1080, 1920), (3000, 200), (5000, 4000)]


@pytest.mark.parametrize("name", ["qwen2_vl_7b", "qwen3_vl_8b", "glm4_1v_9b"])
def test_qwen_style_tokens_follow_transformers_smart_resize(spec, name):
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize as glm_resize
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as qwen_resize

    model = spec(name)
    merge, patch = model.vision["spatial_merge_size"], model.vision["patch_size"]
    for h, w in SIDES:
        if name.startswith("glm"):  # a still image is 2 frames of the temporal patch
            rh, rw = glm_resize(2, h, w, 2, patch * merge, model.min_pixels, model.max_pixels)
        else:
            rh, rw = qwen_resize(h, w, patch * merge, model.min_pixels, model.max_pixels)
        assert image_tokens(model, h, w) == (rh // patch) * (rw // patch) // merge**2, (h, w)


def test_llava_next_tokens_are_the_processors_count(spec):
    from transformers import LlavaNextProcessor

    model = spec("llava_v1_6_mistral_7b")
    processor = LlavaNextProcessor.__new__(LlavaNextProcessor)  # the counting method alone: no tokenizer needed
    processor.image_processor = SimpleNamespace(image_grid_pinpoints=model.image_grid_pinpoints)
    processor.patch_size, processor.num_additional_image_tokens = model.vision["patch_size"], 1
    tile = model.vision["image_size"]
    for h, w in SIDES:
        assert image_tokens(model, h, w) == processor._get_number_of_features(h, w, tile, tile) - 1, (h, w)


def test_idefics3_tiles_are_what_the_real_image_processor_cuts():
    from transformers import Idefics3ImageProcessorPil

    processor = Idefics3ImageProcessorPil(size={"longest_edge": 96}, max_image_size={"longest_edge": 32})
    for h, w in [(10, 50), (50, 10), (33, 33), (90, 20), (7, 7), (64, 63)]:
        real = processor(images=[[Image.new("RGB", (w, h))]], return_row_col_info=True)
        assert idefics3_tiles(h, w, 96, 32) == (real["rows"][0][0], real["cols"][0][0]), (h, w)


def test_pixtral_grid_follows_the_processors_resize():
    from transformers.models.pixtral.image_processing_pil_pixtral import get_resize_output_image_size

    for h, w in SIDES:
        real = get_resize_output_image_size(np.zeros((h, w, 3), dtype=np.uint8), (1024, 1024), (16, 16))
        assert pixtral_grid(h, w, 1024, 16) == (real[0] // 16, real[1] // 16), (h, w)


def test_internvl_tiles_are_the_image_processors_count(spec):
    from transformers import GotOcr2ImageProcessorPil

    model = spec("internvl3_2b")
    processor = GotOcr2ImageProcessorPil(crop_to_patches=True, min_patches=model.min_patches,
                                         max_patches=model.max_patches, size={"height": model.tile, "width": model.tile})
    for h, w in SIDES:
        assert image_tokens(model, h, w) == processor.get_number_of_image_patches(h, w) * model.image_seq_length


@pytest.mark.parametrize("name", ["qwen2_5_vl_7b", "llava_1_5_7b", "llava_onevision_qwen2_7b", "smolvlm_256m",
                                  "internvl3_2b", "gemma3_4b", "paligemma_3b_224", "nanovlm_222m", "pixtral_12b",
                                  "mistral_small_3_1_24b", "deepseek_vl2_tiny", "llama3_2_11b_vision"])
def test_a_square_image_gives_the_specs_own_count(spec, name):
    model = spec(name)
    for side in {model.native_image_size, 896} if model.size_decides_tokens or name.startswith("llava_one") \
            else {model.native_image_size}:
        # Idefics3's data.image_size is its processor's longest edge, not the input's side: the spec's own one here
        data = DataShape(batch_size=1, lm_max_length=100_000, image_size=None if name == "smolvlm_256m" else side)
        assert image_tokens(model, side, side) == model.image_tokens(data), side


def test_a_qwen_video_gives_the_specs_own_count(spec):
    model = spec("qwen2_vl_7b")
    data = DataShape(batch_size=1, lm_max_length=100_000, images_per_sample=0, videos_per_sample=1, video_frames=9,
                     video_size=500)
    assert video_tokens(model, 9, 500, 500) == model.video_tokens(data)


# -- batches ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world,drop_last", [(1, False), (1, True), (2, False), (3, False), (3, True)])
def test_random_batches_are_what_accelerates_prepared_loader_hands_each_rank(world, drop_last):
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader, RandomSampler

    n, batch, seed, epochs = 11, 2, 7, 2
    real = {}
    for rank in range(world):
        data = list(range(n))
        loader = prepare_data_loader(DataLoader(data, sampler=RandomSampler(data), batch_size=batch,
                                                drop_last=drop_last, collate_fn=list),
                                     num_processes=world, process_index=rank, use_seedable_sampler=True,
                                     data_seed=seed)
        real[rank] = []
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            real[rank] += [list(b) for b in loader]
    steps = len(real[0])
    plan = plan_batches(text_only(range(n)), None, batch_size=batch, steps=steps, world_size=world, seed=seed,
                        drop_last=drop_last)
    for rank in range(world):
        assert [list(b.indices) for b in plan if b.rank == rank] == real[rank], rank


def test_group_by_length_is_transformers_length_grouped_sampler():
    from transformers.trainer_pt_utils import LengthGroupedSampler

    lengths = [int(x) for x in torch.randint(1, 500, (97,), generator=torch.Generator().manual_seed(0))]
    real = LengthGroupedSampler(6, lengths=lengths, generator=torch.Generator().manual_seed(5))
    ours = torch.Generator().manual_seed(5)
    for epoch in range(2):  # the generator carries over
        assert sample_order("group_by_length", lengths, epoch, 5, 6, ours) == list(real)
    plan = plan_batches(text_only(lengths), None, batch_size=3, grad_accum=2, steps=1, seed=5, sampler="group_by_length")
    assert max(plan[0].tokens) == max(lengths)  # the longest sample in the first step, as the sampler promises


def test_grad_accum_makes_steps_and_an_epochs_last_step_takes_the_rest():
    plan = plan_batches(text_only([1] * 10), None, batch_size=2, grad_accum=3, steps=3, sampler="sequential")
    assert [(b.step, b.micro, b.epoch, b.indices) for b in plan] == [
        (0, 0, 0, (0, 1)), (0, 1, 0, (2, 3)), (0, 2, 0, (4, 5)), (1, 0, 0, (6, 7)), (1, 1, 0, (8, 9)),
        (2, 0, 1, (0, 1)), (2, 1, 1, (2, 3)), (2, 2, 1, (4, 5))]


def test_truncation_padding_and_image_tokens_by_hand(spec):
    model = spec("llava_1_5_7b")  # 576 tokens per image
    samples = [Sample(0, 10, ((300, 200),)), Sample(1, 300), Sample(2, 5, ((50, 50), (60, 60)))]
    plan = plan_batches(samples, model, batch_size=3, steps=1, sampler="sequential", max_length=1024,
                        pad_to_multiple_of=64)
    [b] = plan
    assert b.tokens == (586, 300, 1024) and b.truncated == 1 and b.padded_length == 1024
    assert b.image_tokens == (576, 0, 1152) and b.images == ((300, 200), (50, 50), (60, 60))
    [b] = plan_batches(samples[:2], model, batch_size=2, steps=1, sampler="sequential", pad_to_multiple_of=64)
    assert b.padded_length == 640 and b.truncated == 0


def test_worst_first_puts_the_longest_samples_in_the_first_step_and_the_csv_names_them(tmp_path):
    plan = plan_batches(text_only([5, 90, 7, 300, 1, 40]), None, batch_size=2, world_size=2, steps=2,
                        sampler="worst_first")
    assert [(b.step, b.rank, b.indices) for b in plan] == [(0, 0, (3, 1)), (0, 1, (5, 2)), (1, 0, (0, 4)),
                                                           (1, 1, (3, 1))]  # the round filled from the first samples
    rows = summarize_plan(plan)
    assert worst(rows)["samples"] == "3 1" and worst(rows)["padded_length"] == 300
    with write_steps_csv(rows, tmp_path / "steps_plan.csv").open() as f:
        read = list(csv.DictReader(f))
    assert tuple(read[0]) == COLUMNS and read[1] == {"step": "0", "micro": "0", "rank": "1", "samples": "5 2",
                                                      "longest_tokens": "40", "padded_length": "40",
                                                      "image_tokens": "0", "images": "", "truncated": "0"}
