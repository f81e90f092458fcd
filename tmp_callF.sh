export PYTHONPATH=src TRITON_CACHE_DIR=/tmp/tc
timeout 240 python -m pytest tests/kernels/test_kernels_linear.py tests/kernels/test_kernels_gla.py tests/kernels/test_kernels_normalized.py tests/kernels/test_kernels_kda.py tests/kernels/test_kernels_delta.py -m gpu -q -x -p no:cacheprovider -k "cu_seqlens or varlen or packed" 2>&1 | tail -2
timeout 230 python experiments/packed_host_reads.py --models gated_delta_net,linear > $OUT/host.jsonl 2> $OUT/host.err; tail -3 $OUT/host.err; cat $OUT/host.jsonl
