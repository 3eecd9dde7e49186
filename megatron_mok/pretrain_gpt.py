"""``python -m megatron_mok.pretrain_gpt <Megatron args> --moe-backend mok``."""

from .adapter.pretrain import main

if __name__ == "__main__":
    main()
