from tokenfleet.services.worker.main import main

if __name__ == "__main__":  # guarded: TensorRT-LLM's MPI workers import the main module again
    raise SystemExit(main(default_role="prefill"))
