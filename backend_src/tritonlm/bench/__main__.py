from tritonlm.bench.cli import main

main()
