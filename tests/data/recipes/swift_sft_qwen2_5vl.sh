# Written for vlmprobe's tests, following ms-swift's examples/train/multimodal/ocr.sh (modelscope/ms-swift@3602360a),
# with two ranks and ZeRO-2 added.
CUDA_VISIBLE_DEVICES=0,1 \
NPROC_PER_NODE=2 \
MAX_PIXELS=1003520 \
swift sft \
    --model Qwen/Qwen2.5-VL-7B-Instruct \
    --dataset 'AI-ModelScope/LaTeX_OCR:human_handwrite#20000' \
    --train_type lora \
    --torch_dtype bfloat16 \
    --per_device_train_batch_size 1 \
    --learning_rate 1e-4 \
    --lora_rank 8 \
    --lora_alpha 32 \
    --target_modules all-linear \
    --freeze_vit true \
    --freeze_aligner true \
    --gradient_accumulation_steps 16 \
    --gradient_checkpointing true \
    --attn_impl flash_attn \
    --max_length 4096 \
    --deepspeed zero2 \
    --output_dir output
