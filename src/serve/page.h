/* The playground page served at GET / (page.c). */
#ifndef KILN_SERVE_PAGE_H
#define KILN_SERVE_PAGE_H
extern const char kiln__page_html[];
extern const unsigned long kiln__page_html_len;
#endif
