"""Image classification with the HF Trainer (the image-classification example's shape): ViT-base/16 from its
config, 100 classes, random 224 x 224 images, batch 64, fp16, remove_unused_columns=False."""

import argparse

import torch
from transformers import Trainer, TrainingArguments, ViTConfig, ViTForImageClassification

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=64)
args = parser.parse_args()


class RandomImages(torch.utils.data.Dataset):
    def __len__(self):
        return args.batch_size * 4

    def __getitem__(self, i):
        return {"pixel_values": torch.randn(3, 224, 224), "labels": i % 100}


model = ViTForImageClassification(ViTConfig(num_labels=100))
trainer = Trainer(
    model=model,
    args=TrainingArguments(
        output_dir="/tmp/vit-food",
        per_device_train_batch_size=args.batch_size,
        max_steps=4,
        fp16=True,
        remove_unused_columns=False,
        save_strategy="no",
        report_to="none",
    ),
    train_dataset=RandomImages(),
)
trainer.train()
