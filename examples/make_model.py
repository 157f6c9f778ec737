"""A model folder of your own, for trying `sltune` on a checkpoint where no hub can be reached: a byte-level BPE
tokenizer trained on your text and a small Llama with random weights, saved as transformers saves them
(config.json, bfloat16 safetensors, the tokenizer files).

    python examples/make_model.py my-model corpus.txt [--hidden 128 --layers 4 --vocab 1024]

A real checkpoint (a folder `save_pretrained` or the Hub wrote) is used the same way: `--model FOLDER`.
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="where to save the model and its tokenizer")
    parser.add_argument("text", help="a text file to train the tokenizer on")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    args = parser.parse_args()

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train([args.text], trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=["<pad>", "<s>", "</s>"],
                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(args.folder)
    tokenizer.save_pretrained(args.folder)
    print(f"saved a {args.layers}-layer Llama (hidden {args.hidden}, vocabulary {len(tokenizer)}) and its tokenizer "
          f"to {args.folder}")


if __name__ == "__main__":
    main()
