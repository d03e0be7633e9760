"""tritonlm's HTTP front end: the OpenAI and TGI APIs and a chat page, served by a process that
talks to tritonserver over gRPC (`tritonlm-frontend`, started by `tritonlm-serve`)."""
