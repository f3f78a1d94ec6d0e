"""Sentence embeddings for a corpus (batch evaluation, no optimizer): BERT-base from its config cast to fp16,
torch.no_grad, mean pooling over the attention mask, batch 128 x 512, 3 batches collected on the CPU."""

import argparse

import torch
from transformers import BertConfig, BertModel

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=128)
parser.add_argument("--seq-len", type=int, default=512)
args = parser.parse_args()

model = BertModel(BertConfig()).cuda().half().eval()
embeddings = []
with torch.no_grad():
    for _ in range(3):
        ids = torch.randint(0, 30522, (args.batch_size, args.seq_len), device="cuda")
        mask = torch.ones_like(ids)
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        embeddings.append(torch.nn.functional.normalize(pooled.float(), dim=-1).cpu())
print(torch.cat(embeddings).shape)
