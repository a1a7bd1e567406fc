/* Chat templates: the default one that kiln train stores with a checkpoint. */
#include "kiln/serve.h"

const char *kiln_chat_template_default(void)
{
    return "{\"message\": \"{role}: {content}\\n\", \"generation\": \"assistant:\", "
           "\"stop\": [\"\\nuser:\", \"\\nsystem:\"]}";
}
