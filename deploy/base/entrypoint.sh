#!/bin/sh
# The tritonlm containers' entrypoint: converts MODEL_SOURCE into the model repository unless the
# model is there already, then runs the given command (tritonserver, or tritonlm-worker).
#   MODEL_SOURCE      a Hugging Face directory, a .gguf file or "default"; empty: convert nothing
#   MODEL_REPOSITORY  the repository; the model is its "llm"
#   CONVERT_ARGS      more tritonlm-convert options, split at spaces ("--dtype bfloat16 --tp 2")
set -eu
model="$MODEL_REPOSITORY/llm"
if [ -z "${MODEL_SOURCE:-}" ]; then
  echo "entrypoint: no MODEL_SOURCE; serving $MODEL_REPOSITORY as it is"
elif [ -f "$model/config.pbtxt" ]; then
  # NOTE: the converter writes config.pbtxt last, so its presence means a complete model
  echo "entrypoint: $model is converted already"
else
  echo "entrypoint: converting $MODEL_SOURCE into $model"
  # shellcheck disable=SC2086  # CONVERT_ARGS holds several options
  tritonlm-convert "$MODEL_SOURCE" --output "$MODEL_REPOSITORY" ${CONVERT_ARGS:-}
fi
exec "$@"
