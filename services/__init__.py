"""The three worker services, each a separate OS process: weight_store, gpu_expert, cpu_attention."""
