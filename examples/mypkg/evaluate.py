"""Evaluation as a module (python -m mypkg.evaluate --split val): every rank sums its correct answers.

    distcheck run -m mypkg.evaluate --nproc-per-node 4 -- --split val
"""

import argparse

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--split", default="val")
    args = p.parse_args()
    dist.init_process_group("gloo")
    correct = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(correct)
    if dist.get_rank() == 0:
        print(f"{args.split}: {correct.item():g} correct", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
