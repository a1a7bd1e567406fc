/* The page served at GET /: src/serve/page.html, embedded at build time by
 * cmake/embed.cmake (the generated build/embed/kiln__page_html.c). */
#ifndef KILN_SERVE_PAGE_H
#define KILN_SERVE_PAGE_H
extern const char kiln__page_html[];
extern const unsigned long kiln__page_html_len; /* bytes, without the NUL */
#endif
