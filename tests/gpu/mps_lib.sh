# CUDA MPS for one benchmark call (sourced): start_mps DIR starts a control daemon whose pipe and
# log folders are under DIR (so only the processes started after it, which inherit
# CUDA_MPS_PIPE_DIRECTORY, become its clients), stop_mps DEST quits it and copies its logs (which
# name every client that connected) to DEST. Nothing of the GPU's settings changes: no compute
# mode, no exclusive process; the server goes when the daemon quits.
start_mps() {
  export CUDA_MPS_PIPE_DIRECTORY=$1/pipe CUDA_MPS_LOG_DIRECTORY=$1/log
  rm -rf "$1" && mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d
}
stop_mps() {
  [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] || return 0
  echo quit | nvidia-cuda-mps-control
  sleep 1
  [ -n "${1:-}" ] && cp -r "$CUDA_MPS_LOG_DIRECTORY" "$1" 2>/dev/null
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  return 0
}
